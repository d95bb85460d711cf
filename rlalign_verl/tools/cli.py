"""``rlalign-verl`` command line: ``diagnose``, ``report``, ``profiles``."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "diagnose": "rlalign_verl.tools.diagnose.command",
    "report": "rlalign_verl.tools.report.command",
}


def _profiles(args: argparse.Namespace) -> int:
    from rlalign_verl.catalog.profiles import PROFILES
    from rlalign_verl.catalog.profiles_tp import reduction
    from rlalign_verl.tools.profile_table import tp_cell

    for p in PROFILES.values():
        print(f"{p.name:15s} {p.engine}/{p.device:4s}  {p.summary}")
        print(f"{'':15s} verified: {p.verified}")
        print(f"{'':15s} rollout TP > 1 (the tp region): {tp_cell(reduction(p))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlalign-verl",
        description="Rounding-location alignment between inference engines and the training stack.",
    )
    from importlib.metadata import version

    parser.add_argument("--version", action="version", version=f"rlalign-verl {version('rlalign-verl')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    p = sub.add_parser("profiles", help="list the engine profiles and what each was verified against")
    p.set_defaults(func=_profiles)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        func = importlib.import_module(SUBCOMMANDS[args.command]).run
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
