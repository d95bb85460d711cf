#!/usr/bin/env python
"""Render the engine-profile table from rlalign_verl/catalog/profiles.py into docs/engine-profiles.md.

python scripts/profile_table.py --write   # rewrite the generated blocks
python scripts/profile_table.py --check   # exit 1 naming each document whose table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlalign_verl.tools.profile_table import render, replace_block

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "docs" / "engine-profiles.md",)


def stale(paths: tuple[Path, ...] = DOCUMENTS) -> list[Path]:
    """The documents whose generated table differs from the profiles."""
    table = render()
    return [p for p in paths if replace_block(p.read_text(), table) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    mode.add_argument("--check", action="store_true", help="fail when a generated block is stale")
    args = ap.parse_args(argv)
    if args.write:
        for p in DOCUMENTS:
            p.write_text(replace_block(p.read_text(), render()))
        return 0
    bad = stale()
    for p in bad:
        print(f"{p.relative_to(ROOT)}: profile table differs from rlalign_verl/catalog/profiles.py; "
              "run python scripts/profile_table.py --write", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
