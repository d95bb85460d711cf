"""The ``report`` subcommand: ``rlalign-verl report RUN [RUN ...] --out DIR`` (and ``--tensorboard-layout``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlalign_verl.base.errors import AlignmentError, one_line

if TYPE_CHECKING:
    from rlalign_verl.tools.report.runs import Run

DEFAULT_TITLE = "rlalign-verl mismatch report"


def add_parser(subparsers: Any) -> None:
    """Register the ``report`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="plot and compare the mismatch metrics of verl runs (PNG + self-contained HTML)",
        description="Plot and compare the mismatch/* metrics of verl runs: one PNG per panel and report.html. "
        "With --tensorboard-layout LOGDIR alone: write TensorBoard's custom-scalars layout instead.",
    )
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="a verl file-logger JSONL file (or a directory holding one) or a TensorBoard event directory",
    )
    parser.add_argument("--out", help="output directory (created; a symbolic link is refused)")
    parser.add_argument(
        "--labels", default=None, help="comma-separated run names, one per RUN (default: file/dir name)"
    )
    parser.add_argument("--title", default=None, help=f"page title (default: {DEFAULT_TITLE!r})")
    parser.add_argument(
        "--tensorboard-layout",
        metavar="LOGDIR",
        help="instead of a report: write only the custom-scalars layout (mismatch/* grouped) into a TensorBoard "
        "log directory and exit; given alone, without RUN, --out, --labels or --title",
    )


def _directory(value: str | None, flag: str) -> Path | None:
    if value is None:
        return None
    if not value.strip():  # an unset shell variable: never the current directory by accident
        raise AlignmentError(f"{flag} is empty; pass a directory path")
    return Path(value).expanduser()


def _labels(args: argparse.Namespace) -> list[str | None]:
    if not args.labels:
        return [None] * len(args.runs)
    labels = [s.strip() or None for s in args.labels.split(",")]
    if len(labels) != len(args.runs):
        raise AlignmentError(f"--labels has {len(labels)} names for {len(args.runs)} runs; give one per RUN")
    named = [x for x in labels if x]
    twice = sorted({x for x in named if named.count(x) > 1})
    if twice:
        raise AlignmentError(f"--labels names {', '.join(twice)} more than once; give each run its own name")
    return labels


def _distinct(runs: list[Run]) -> None:
    """Two runs with one default label (``a/exp`` and ``b/exp``): number the later ones, and say so."""
    taken: set[str] = set()
    for r in runs:
        label, n = r.label, 1
        while label in taken:
            n += 1
            label = f"{r.label} ({n})"
        if label != r.label:
            r.problems.append(
                f"another run is also named {r.label!r}: this one ({r.source}) is shown as {label!r}"
            )
            r.label = label
        taken.add(label)


def _layout_alone(args: argparse.Namespace) -> None:
    """``--tensorboard-layout`` writes only the layout: refuse report arguments given with it, never ignore them."""
    flags = {"--out": args.out, "--labels": args.labels, "--title": args.title}
    given = (["RUN"] if args.runs else []) + [flag for flag, value in flags.items() if value is not None]
    if given:
        raise AlignmentError(
            f"--tensorboard-layout writes only the layout, not a report, and {'/'.join(given)} would be ignored; "
            "run it without RUN/--out/--labels/--title, or drop --tensorboard-layout to write the report"
        )


def run(args: argparse.Namespace) -> int:
    """Run ``report``; 0 on success, 2 with one ``[rlalign-verl] ERROR`` line for bad input.

    Every refusal (bad runs, --tensorboard-layout given with a report's arguments, an --out or layout
    directory that is a link, a file, read-only, or holds a link or a directory where a report file goes)
    comes before the first file is written.
    """
    try:
        layout_dir = _directory(args.tensorboard_layout, "--tensorboard-layout")
        if layout_dir is not None:
            _layout_alone(args)
            from rlalign_verl.tools.report.tensorboard import write_layout

            print(f"wrote the custom-scalars layout into {write_layout(layout_dir)}")
            return 0
        out = _directory(args.out, "--out")
        if not args.runs or out is None:
            raise AlignmentError("report needs RUN [RUN ...] and --out DIR (or --tensorboard-layout LOGDIR)")
        from rlalign_verl.tools.report.page import write_report
        from rlalign_verl.tools.report.runs import load_run

        labels = _labels(args)
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
        _distinct(runs)
        page = write_report(runs, out, title=DEFAULT_TITLE if args.title is None else args.title)
    except AlignmentError as err:
        print(one_line(err), file=sys.stderr)
        return 2
    for r in runs:
        for problem in r.problems:
            print(f"[rlalign-verl] WARNING {r.label}: {problem}", file=sys.stderr)
    print(f"wrote {page} ({len(runs)} runs)")
    return 0
