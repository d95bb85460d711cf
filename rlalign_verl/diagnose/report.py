"""``rlalign-verl report``: plots comparing the mismatch metrics of several verl runs.

Reads each run from verl's ``file`` logger output (JSONL lines ``{"step": N, "data": {key: value}}``,
written to ``$VERL_FILE_LOGGER_PATH`` or ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``) or from a
TensorBoard event directory (``trainer.logger=[tensorboard]``: ``$TENSORBOARD_DIR`` or
``tensorboard_log/<project>/<experiment>``), and writes one PNG per panel, an overview PNG with every panel
on a shared step axis, and ``report.html`` with all images embedded (base64), so the page is self-contained.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlalign_verl.errors import AlignmentError

from .files import atomic_target, prepare_out_dir, write_text

__all__ = ["PANELS", "Panel", "Run", "load_run", "write_report", "add_parser", "run"]

_SOURCES_HINT = (
    "expected verl's file-logger JSONL (trainer.logger=[...,file]; VERL_FILE_LOGGER_PATH or "
    "<VERL_FILE_LOGGER_ROOT>/<project>/<experiment>.jsonl) or a TensorBoard event directory "
    "(trainer.logger=[...,tensorboard]; TENSORBOARD_DIR or tensorboard_log/<project>/<experiment>)"
)


@dataclass(frozen=True)
class Panel:
    """One plot: ``keys`` drawn per run (first key solid, the others dashed/dotted)."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    logy: bool = False


#: The panels, in page order; a panel is drawn when at least one run has one of its keys.
PANELS: tuple[Panel, ...] = (
    Panel(
        "logp_gap",
        "Train-vs-rollout log-prob gap",
        "|Δ log p| (nats)",
        ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_p99"),
    ),
    Panel("kl", "KL(rollout ‖ train), k3 estimator", "nats / token", ("mismatch/kl_k3",)),
    Panel(
        "ratio_extremes",
        "Importance ratio extremes π_train/π_rollout",
        "ratio",
        ("mismatch/ratio_max", "mismatch/ratio_min"),
        logy=True,
    ),
    Panel("clip_frac", "Tokens outside the PPO clip range", "fraction", ("mismatch/ratio_clip_frac",)),
    Panel(
        "seq_log_ratio",
        "Sequence |Σ Δ log p|",
        "nats / sequence",
        ("mismatch/seq_log_ratio_abs_mean", "mismatch/seq_log_ratio_abs_max"),
    ),
    Panel("reward", "Reward (sequence score)", "score", ("critic/score/mean",)),
    Panel("entropy", "Actor entropy", "nats", ("actor/entropy",)),
    Panel("grad_norm", "Actor grad norm", "norm", ("actor/grad_norm",), logy=True),
)
_LINESTYLES = ("-", "--", ":", "-.")


@dataclass
class Run:
    """A run's scalar series: ``series[key] = [(step, value), ...]`` sorted by step."""

    label: str
    source: str
    kind: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def last(self, key: str) -> float | None:
        points = self.series.get(key)
        return points[-1][1] if points else None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        v = float(value)
        return v if math.isfinite(v) else None
    return None


def _load_jsonl(path: Path) -> dict[str, list[tuple[int, float]]]:
    by_key: dict[str, dict[int, float]] = {}
    good = bad = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise AlignmentError(f"{path} is not a text JSONL file (binary content); {_SOURCES_HINT}") from None
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, data = int(row["step"]), row["data"]
            if not isinstance(data, dict):
                raise TypeError("data is not an object")
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        good += 1
        for key, value in data.items():
            v = _as_float(value)
            if v is not None:
                by_key.setdefault(key, {})[step] = v  # a resumed run's later line wins
    if good == 0:
        raise AlignmentError(f"{path}: no verl metrics lines ({bad} unreadable); {_SOURCES_HINT}")
    return {k: sorted(v.items()) for k, v in by_key.items()}


def _load_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise AlignmentError(
            f"{directory} holds TensorBoard events but the tensorboard package is missing: pip install tensorboard"
        ) from err
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    series: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        points: dict[int, float] = {}
        for event in acc.Scalars(tag):
            v = _as_float(event.value)
            if v is not None:
                points[int(event.step)] = v
        if points:
            series[tag] = sorted(points.items())
    return series


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Load one run from a JSONL file, a directory holding one, or a TensorBoard event directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AlignmentError(f"run {path} does not exist; {_SOURCES_HINT}")
    if path.is_file():
        if path.name.startswith("events.out.tfevents"):
            return load_run(path.parent, label)
        series, kind = _load_jsonl(path), "jsonl"
        default_label = path.stem
    else:
        event_dirs = sorted({p.parent for p in path.rglob("events.out.tfevents*") if p.is_file()})
        jsonl_files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if len(event_dirs) > 1:
            raise AlignmentError(
                f"{path} holds several TensorBoard runs ({', '.join(str(d) for d in event_dirs)}); pass one of them"
            )
        if event_dirs:
            series, kind = _load_tensorboard(event_dirs[0]), "tensorboard"
        elif len(jsonl_files) == 1:
            series, kind = _load_jsonl(jsonl_files[0]), "jsonl"
        elif jsonl_files:
            raise AlignmentError(
                f"{path} holds several JSONL files ({', '.join(p.name for p in jsonl_files)}); pass one of them"
            )
        else:
            raise AlignmentError(f"no verl metrics in {path}: it is empty or holds no run; {_SOURCES_HINT}")
        default_label = path.name
    if not series:
        raise AlignmentError(f"{path}: no numeric metrics found; {_SOURCES_HINT}")
    return Run(label=label or default_label, source=str(path), kind=kind, series=series)


def _plot_panel(ax: Any, panel: Panel, runs: list[Run], colors: list[Any]) -> bool:
    from matplotlib.ticker import MaxNLocator

    drawn = False
    for run_, color in zip(runs, colors, strict=True):
        for key, style in zip(panel.keys, _LINESTYLES, strict=False):
            points = run_.series.get(key)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            suffix = "" if len(panel.keys) == 1 else f" · {key.rsplit('/', 1)[-1]}"
            ax.plot(
                steps,
                values,
                linestyle=style,
                color=color,
                marker="." if len(points) < 30 else None,
                label=f"{run_.label}{suffix}",
            )
            drawn = True
    if drawn:
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        values = [v for r in runs for k in panel.keys for _, v in r.series.get(k, [])]
        if panel.logy and all(v > 0 for v in values):
            _log_axis(ax, min(values), max(values))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return drawn


def _log_axis(ax: Any, lo: float, hi: float) -> None:
    """Log y axis; over less than two decades, plain evenly spaced ticks (0.8, 0.9, 1.0, 1.1 ...)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

    ax.set_yscale("log")
    if hi / lo < 100:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=7))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
        ax.yaxis.set_minor_locator(NullLocator())


def write_report(runs: list[Run], out: str | Path, *, title: str = "rlalign-verl mismatch report") -> Path:
    """Write ``<panel>.png`` per drawn panel, ``overview.png`` and ``report.html`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise AlignmentError("no runs given")
    panels = [p for p in PANELS if any(k in r.series for r in runs for k in p.keys)]
    if not panels:
        known = sorted({k for p in PANELS for k in p.keys})
        raise AlignmentError(
            "none of the runs has a metric to plot (looked for " + ", ".join(known) + "); were the runs "
            "made with the rlalign-verl plugin and alignment.metrics=true?"
        )
    out = prepare_out_dir(out)
    cmap = plt.get_cmap("tab10")
    colors = [cmap(i % 10) for i in range(len(runs))]

    images: list[tuple[str, Path]] = []
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.6 * rows), sharex=True, squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _plot_panel(ax, panel, runs, colors)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    overview = out / "overview.png"
    with atomic_target(overview) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    images.append(("Overview", overview))
    for panel in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_panel(ax, panel, runs, colors)
        fig.tight_layout()
        png = out / f"{panel.name}.png"
        with atomic_target(png) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
        plt.close(fig)
        images.append((panel.title, png))

    page = out / "report.html"
    write_text(page, _html(title, runs, images))
    return page


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def _html(title: str, runs: list[Run], images: list[tuple[str, Path]]) -> str:
    summary_keys = (
        "mismatch/logp_abs_diff_mean",
        "mismatch/kl_k3",
        "mismatch/ratio_clip_frac",
        "critic/score/mean",
    )
    head = "".join(f"<th>last {html.escape(k)}</th>" for k in summary_keys)
    rows = []
    for r in runs:
        steps = sorted({s for pts in r.series.values() for s, _ in pts})
        cells = "".join(f"<td>{_fmt(r.last(k))}</td>" for k in summary_keys)
        rows.append(
            f"<tr><td>{html.escape(r.label)}</td><td>{html.escape(r.kind)}</td>"
            f"<td><code>{html.escape(r.source)}</code></td><td>{len(steps)}</td>{cells}</tr>"
        )
    figures = []
    for caption, png in images:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        figures.append(
            f'<figure id="{html.escape(png.stem)}"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(caption)} '
            f"({html.escape(png.name)})</figcaption></figure>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;font-size:90%}img{max-width:100%}"
        "figure{margin:1.5em 0}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        "<p>mismatch/* are logged by rlalign-verl on every step (train-vs-rollout log-probs of the sampled "
        "tokens); reward, entropy and grad norm are verl's own metrics.</p>"
        f"<table><tr><th>run</th><th>format</th><th>source</th><th>steps</th>{head}</tr>{''.join(rows)}</table>"
        f"{''.join(figures)}</body></html>\n"
    )


def add_parser(subparsers: Any) -> None:
    """Register the ``report`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="plot and compare the mismatch metrics of verl runs (PNG + self-contained HTML)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a verl file-logger JSONL file (or a directory holding one) or a TensorBoard event directory",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory (created)")
    parser.add_argument(
        "--labels", default=None, help="comma-separated run names, one per RUN (default: file/dir name)"
    )
    parser.add_argument("--title", default="rlalign-verl mismatch report", help="page title")


def run(args: argparse.Namespace) -> int:
    """Run ``report``; 0 on success, 2 (with a message on stderr) for bad input."""
    try:
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else [None] * len(args.runs)
        if len(labels) != len(args.runs):
            raise AlignmentError(
                f"--labels has {len(labels)} names for {len(args.runs)} runs; give one per RUN"
            )
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
        page = write_report(runs, args.out, title=args.title)
    except AlignmentError as err:
        print(f"rlalign-verl report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {page} ({len(runs)} runs)")
    return 0
