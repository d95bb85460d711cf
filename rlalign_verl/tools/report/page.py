"""The report's page: one PNG per panel, an overview PNG, and ``report.html`` with every image embedded
(base64), so the page is self-contained. Runs come from :mod:`.runs` (checked); the panels are data (:data:`PANELS`).
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.base.files import open_out_dir
from rlalign_verl.tools.report.runs import BANDS, Run, check_bands

__all__ = ["PANELS", "Panel", "plot_panel", "write_report"]


@dataclass(frozen=True)
class Panel:
    """One plot: ``keys`` drawn per run (first key solid, the others dashed/dotted)."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    logy: bool = False
    hint: str = ""
    """One line under the plot: which way is better, what the lines are."""
    band: tuple[str, str] | None = None
    """Keys of a 95% interval drawn as an error bar around each point of the first key (a point whose
    interval does not hold it gets none; :func:`.runs.check_bands` says which)."""
    ref: float | None = None
    """A horizontal reference line (e.g. gain 1: no effect)."""


#: The panels, in page order; a panel is drawn when at least one run has one of its keys.
PANELS: tuple[Panel, ...] = (
    Panel(
        "logp_gap",
        "Train-vs-rollout log-prob gap",
        "|Δ log p| (nats per token)",
        ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_p99"),
        hint="lower is better; solid: mean over the step's tokens, dashed: 99th percentile",
    ),
    Panel(
        "verify_gap",
        "In-run verification: aligned vs unaligned, same tokens",
        "|Δ log p| (nats per token)",
        ("mismatch/verify/aligned", "mismatch/verify/unaligned"),
        hint="measured at verify steps only; solid: the run's alignment, dashed: alignment switched off",
    ),
    Panel(
        "verify_gain",
        "Verification gain = unaligned / aligned (95% interval)",
        "gain (×)",
        ("mismatch/verify/gain",),
        band=BANDS["mismatch/verify/gain"],
        ref=1.0,
        hint="above 1 (the dotted line): alignment brings the trainer closer to the engine; below 1: farther",
    ),
    Panel(
        "kl",
        "KL(rollout ‖ train), k3 estimator",
        "nats per token",
        ("mismatch/kl_k3",),
        hint="lower is better",
    ),
    Panel(
        "ratio_extremes",
        "Importance ratio extremes π_train/π_rollout",
        "ratio (log scale)",
        ("mismatch/ratio_max", "mismatch/ratio_min"),
        logy=True,
        ref=1.0,
        hint="closer to 1 is better; solid: max, dashed: min",
    ),
    Panel(
        "clip_frac",
        "Tokens outside the PPO clip range",
        "fraction of tokens",
        ("mismatch/ratio_clip_frac",),
        hint="lower is better",
    ),
    Panel(
        "seq_log_ratio",
        "Sequence |Σ Δ log p|",
        "nats per sequence",
        ("mismatch/seq_log_ratio_abs_mean", "mismatch/seq_log_ratio_abs_max"),
        hint="lower is better; solid: mean, dashed: max",
    ),
    Panel("reward", "Reward (sequence score)", "score", ("critic/score/mean",), hint="verl's own metric"),
    Panel("entropy", "Actor entropy", "nats per token", ("actor/entropy",), hint="verl's own metric"),
    Panel(
        "grad_norm",
        "Actor grad norm",
        "norm (log scale)",
        ("actor/grad_norm",),
        logy=True,
        hint="verl's own metric; a spike after a gap spike is the collapse signature",
    ),  # fmt: skip
)
_LINESTYLES = ("-", "--", ":", "-.")


def plot_panel(ax: Any, panel: Panel, runs: list[Run], colors: list[Any]) -> bool:
    """Draw ``panel`` for every run on ``ax``; False when no run has any of its keys.

    Run labels (user text: ``--labels`` or file names) are drawn literally: no mathtext, no LaTeX, a
    leading underscore kept in the legend.
    """
    from matplotlib.ticker import MaxNLocator

    drawn = False
    handles: list[Any] = []
    labels: list[str] = []
    for run_, color in zip(runs, colors, strict=True):
        for key, style in zip(panel.keys, _LINESTYLES, strict=False):
            points = run_.series.get(key)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            suffix = "" if len(panel.keys) == 1 else f" · {key.rsplit('/', 1)[-1]}"
            (line,) = ax.plot(steps, values, linestyle=style, color=color, markersize=4,
                              marker="o" if len(points) < 30 else None)  # fmt: skip
            handles.append(line)
            labels.append(f"{run_.label}{suffix}")
            drawn = True
            if panel.band and key == panel.keys[0]:  # the interval of each point (verify steps are sparse)
                lo, hi = (dict(run_.series.get(k, [])) for k in panel.band)
                value = dict(points)
                # only an interval that holds its point (check_bands dropped and named the others)
                shown = [s for s in steps if s in lo and s in hi and lo[s] <= value[s] <= hi[s]]
                if shown:
                    err = [[value[s] - lo[s] for s in shown], [hi[s] - value[s] for s in shown]]
                    bars = ax.errorbar(shown, [value[s] for s in shown], yerr=err, fmt="none", ecolor=color,
                                       capsize=4, alpha=0.7)  # fmt: skip
                    handles.append(bars)
                    labels.append(f"{run_.label} · 95% interval")
    if drawn:
        _literal(
            [
                ax.set_title(panel.title, fontsize=10),
                ax.set_xlabel("training step"),
                ax.set_ylabel(panel.ylabel),
            ]
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if panel.ref is not None:
            ax.axhline(panel.ref, color="grey", linestyle=":", linewidth=1)
        values = [v for r in runs for k in panel.keys for _, v in r.series.get(k, [])]
        if panel.logy and all(v > 0 for v in values):
            _log_axis(ax, min(values), max(values))
        ax.grid(True, alpha=0.3)
        ax.legend(handles, labels, fontsize=7)  # given explicitly: a label "_x" is not dropped
        _literal(ax.get_legend().get_texts())
    return drawn


def _literal(texts: Any) -> None:
    """Draw each text as its characters: ``$...$`` is no mathtext, ``\\`` no LaTeX (user text never parses)."""
    for text in texts:
        text.set_parse_math(False)
        text.set_usetex(False)


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
    if not runs:
        raise AlignmentError("no runs given")
    for r in runs:  # load_run has checked a loaded run; a Run built otherwise is checked here
        check_bands(r.series, r.problems)
    panels = [p for p in PANELS if any(k in r.series for r in runs for k in p.keys)]
    if not panels:
        known = sorted({k for p in PANELS for k in p.keys})
        raise AlignmentError(
            "none of the runs has a metric to plot (looked for " + ", ".join(known) + "); were the runs "
            "made with the rlalign-verl plugin and alignment.metrics=true?"
        )
    names = ["overview.png", *(f"{p.name}.png" for p in panels), "report.html"]
    with open_out_dir(out) as out_dir:
        out_dir.check(names)  # --out and every target checked before the first byte is written
        with matplotlib.rc_context({"text.usetex": False}):  # a matplotlibrc's LaTeX never sees user text
            images = _draw(runs, panels, title)
        page = _html(title, runs, images).encode("utf-8")
        for _, name, data in images:
            out_dir.write(name, data)
        return out_dir.write("report.html", page)


def _draw(runs: list[Run], panels: list[Panel], title: str) -> list[tuple[str, str, bytes]]:
    """The overview and one image per panel, drawn in memory: ``(caption, file name, PNG bytes)``."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    colors = [cmap(i % 10) for i in range(len(runs))]
    images: list[tuple[str, str, bytes]] = []
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.6 * rows), sharex=True, squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        plot_panel(ax, panel, runs, colors)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    _literal([fig.suptitle(title)])
    fig.tight_layout()
    images.append(("Overview", "overview.png", _png(fig)))
    plt.close(fig)
    for panel in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        plot_panel(ax, panel, runs, colors)
        fig.tight_layout()
        caption = f"{panel.title} — {panel.hint}" if panel.hint else panel.title
        images.append((caption, f"{panel.name}.png", _png(fig)))
        plt.close(fig)
    return images


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    return buf.getvalue()


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def _html(title: str, runs: list[Run], images: list[tuple[str, str, bytes]]) -> str:
    summary_keys = (
        "mismatch/logp_abs_diff_mean",
        "mismatch/kl_k3",
        "mismatch/ratio_clip_frac",
        "mismatch/verify/gain",
        "critic/score/mean",
    )
    head = "".join(f"<th>last {html.escape(k)}</th>" for k in summary_keys)
    problems = [f"<li><b>{html.escape(r.label)}</b>: {html.escape(p)}</li>" for r in runs for p in r.problems]
    problem_html = (
        f'<section id="data-problems"><h2>Data problems</h2><ul>{"".join(problems)}</ul></section>'
        if problems
        else ""
    )
    rows = []
    for r in runs:
        steps = sorted({s for pts in r.series.values() for s, _ in pts})
        cells = "".join(f"<td>{_fmt(r.last(k))}</td>" for k in summary_keys)
        rows.append(
            f"<tr><td>{html.escape(r.label)}</td><td>{html.escape(r.kind)}</td>"
            f"<td><code>{html.escape(r.source)}</code></td><td>{len(steps)}</td>{cells}</tr>"
        )
    figures = []
    for caption, name, png in images:
        data = base64.b64encode(png).decode("ascii")
        figures.append(
            f'<figure id="{html.escape(Path(name).stem)}"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(caption)} '
            f"({html.escape(name)})</figcaption></figure>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;font-size:90%}img{max-width:100%}"
        "figure{margin:1.5em 0}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        "<p>mismatch/* are logged by rlalign-verl on every step: the gap between the trainer's and the rollout "
        "engine's log-probs of the sampled tokens (Δ = log π_train − log π_rollout; lower is better). "
        "mismatch/verify/* are measured at verify steps only: the same tokens recomputed with alignment switched "
        "off (gain above 1: alignment helps). Reward, entropy and grad norm are verl's own metrics. "
        "The x axis is the training step.</p>"
        f"<table><tr><th>run</th><th>format</th><th>source</th><th>steps</th>{head}</tr>{''.join(rows)}</table>"
        f"{problem_html}{''.join(figures)}</body></html>\n"
    )
