"""The ``report`` subcommand: ``rlalign-verl report RUN [RUN ...] --out DIR`` (and ``--tensorboard-layout``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import AlignmentError, one_line


def add_parser(subparsers: Any) -> None:
    """Register the ``report`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="plot and compare the mismatch metrics of verl runs (PNG + self-contained HTML)",
        description="Plot and compare the mismatch/* metrics of verl runs: one PNG per panel and report.html.",
    )
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="a verl file-logger JSONL file (or a directory holding one) or a TensorBoard event directory",
    )
    parser.add_argument("--out", type=Path, help="output directory (created)")
    parser.add_argument(
        "--labels", default=None, help="comma-separated run names, one per RUN (default: file/dir name)"
    )
    parser.add_argument("--title", default="rlalign-verl mismatch report", help="page title")
    parser.add_argument(
        "--tensorboard-layout",
        type=Path,
        metavar="LOGDIR",
        help="write the custom-scalars layout (mismatch/* grouped) into a TensorBoard log directory and exit",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``report``; 0 on success, 2 with one ``[rlalign-verl] ERROR`` line for bad input."""
    try:
        if args.tensorboard_layout is not None:
            from .tensorboard import write_layout

            print(f"wrote the custom-scalars layout into {write_layout(args.tensorboard_layout)}")
            return 0
        if not args.runs or args.out is None:
            raise AlignmentError("report needs RUN [RUN ...] and --out DIR (or --tensorboard-layout LOGDIR)")
        from .page import write_report
        from .runs import load_run

        labels = [s.strip() for s in args.labels.split(",")] if args.labels else [None] * len(args.runs)
        if len(labels) != len(args.runs):
            raise AlignmentError(
                f"--labels has {len(labels)} names for {len(args.runs)} runs; give one per RUN"
            )
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
        page = write_report(runs, args.out, title=args.title)
    except AlignmentError as err:
        print(one_line(err), file=sys.stderr)
        return 2
    for r in runs:
        for problem in r.problems:
            print(f"[rlalign-verl] WARNING {r.label}: {problem}", file=sys.stderr)
    print(f"wrote {page} ({len(runs)} runs)")
    return 0
