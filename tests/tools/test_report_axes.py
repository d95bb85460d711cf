"""``rlalign-verl report`` axes: whole-number steps, a readable ratio axis."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlalign_verl.tools.report.page import PANELS, plot_panel  # noqa: E402
from rlalign_verl.tools.report.runs import Run  # noqa: E402

RATIO = next(p for p in PANELS if p.name == "ratio_extremes")


def _draw(run: Run, panel=RATIO):
    fig, ax = plt.subplots()
    assert plot_panel(ax, panel, [run], ["C0"])
    fig.canvas.draw()
    return fig, ax


def test_three_steps_get_integer_ticks_only():
    run = Run("a", "x", "jsonl", {"mismatch/ratio_max": [(1, 1.2), (2, 1.25), (3, 1.1)]})
    fig, ax = _draw(run)
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_ratio_axis_has_plain_labels():
    run = Run(
        "a",
        "x",
        "jsonl",
        {"mismatch/ratio_max": [(1, 1.2), (2, 1.3)], "mismatch/ratio_min": [(1, 0.8), (2, 0.85)]},
    )
    fig, ax = _draw(run)
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert ax.get_yscale() == "log"
    assert len(labels) >= 4, labels  # more than the three 0.8/0.9/1.0 of the default log ticks
    assert all("10^" not in s and "times" not in s for s in labels), labels  # no mixed mathtext notation
    assert all(float(s) > 0 for s in labels), labels


def test_wide_ratio_range_keeps_decade_ticks():
    run = Run(
        "a",
        "x",
        "jsonl",
        {"mismatch/ratio_max": [(1, 1e3), (2, 1e4)], "mismatch/ratio_min": [(1, 1e-2), (2, 0.5)]},
    )
    fig, ax = _draw(run)
    plt.close(fig)
    assert ax.get_yscale() == "log" and ax.yaxis.get_minor_locator().__class__.__name__ != "NullLocator"
