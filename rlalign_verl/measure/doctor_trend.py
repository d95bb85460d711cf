"""The gap's trend over steps: mean |Δ| per step, its least-squares growth and a 95% t interval.

Rounding at a fixed model state does not grow; rollout weights lagging the trainer (async or partial rollouts, a
failed weight sync) make the gap grow step by step. :class:`GapTrend` gives ``mismatch/doctor/gap_growth*``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from rlalign_verl.measure.tensor_inputs import check_int, check_number, check_step, check_str, input_error

__all__ = ["GapTrend", "MIN_POINTS"]

PREFIX = "mismatch/doctor/"
MIN_POINTS = 5
"""Steps before a slope is fitted (the default ``min_points``); at least 3 leave the fit a degree of freedom."""

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip
"""Student t 97.5% quantiles for 1..30 degrees of freedom."""


def _t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df)  # Cornish-Fisher: within 0.003 of the exact quantile beyond 30


class GapTrend:
    """Mean |Δ| over the last ``window`` steps and its growth per step (least-squares slope, 95% t interval).

    ``gap_growth`` is in nats/token per step; ``gap_growth_rel`` is the fitted change across the window divided by
    the window's mean gap. A repeated step replaces its value; a step going back (a resumed run) starts afresh.
    """

    def __init__(self, window: int = 20, min_points: int = MIN_POINTS, prefix: str = PREFIX) -> None:
        where = "GapTrend"
        min_points = check_int(where, "min_points", min_points, minimum=3,
                               hint=f": a slope and its interval need 3 steps (default {MIN_POINTS})")  # fmt: skip
        window = check_int(where, "window", window, hint=" (default 20)")
        if window < min_points:
            raise input_error(where, f"window={window} is below min_points={min_points}; give window >= "
                              f"{min_points} or a smaller min_points")  # fmt: skip
        self.window, self.min_points = window, min_points
        self.prefix = check_str(where, "prefix", prefix, hint=f" (default {PREFIX!r})")
        self.points: list[tuple[float, float]] = []

    def update(self, step: int, abs_mean: Any) -> dict[str, float]:
        """Add one step's mean |Δ|; the ``gap_growth*`` keys once ``min_points`` steps are in (else ``{}``; a
        NaN/inf gap is skipped)."""
        step = check_step("GapTrend.update", step)
        if isinstance(abs_mean, numbers.Real) and not math.isfinite(abs_mean):
            return {}
        abs_mean = check_number("GapTrend.update", "abs_mean", abs_mean, low=0.0, hint=" (mean |Δ| in nats)")
        if self.points and step <= self.points[-1][0]:
            self.points = self.points[:-1] if step == self.points[-1][0] else []
        self.points = [*self.points, (float(step), float(abs_mean))][-self.window :]
        n = len(self.points)
        if n < self.min_points:
            return {}
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in self.points) / sxx
        resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in self.points)
        half = _t975(n - 2) * math.sqrt(resid / (n - 2) / sxx)
        rel = slope * (xs[-1] - xs[0]) / my if my > 0 else 0.0
        out = {
            "gap_growth": slope,
            "gap_growth_lo": slope - half,
            "gap_growth_hi": slope + half,
            "gap_growth_rel": rel,
        }
        return {self.prefix + k: v for k, v in out.items()}
