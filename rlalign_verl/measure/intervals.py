"""The one bootstrap: seeded resampling of independent units (sequences, prompts) and percentile intervals.

Tokens of one response are not independent, so the unit is a sequence (the doctor, the step-1 verify) or a
prompt with all its responses (``diagnose``). Statistics are ratios of sums over the drawn units (a token mean is
``sum of |Δ| / sum of token counts``); every statistic of one call is computed on the same draws, so paired
differences (aligned vs unaligned, one ladder rung vs the previous) keep their pairing.

The rules every caller shares (a bad argument is a :class:`~rlalign_verl.base.errors.MetricsInputError` naming it):

- :data:`MIN_UNITS`: below it there is no interval to decide on (:func:`enough_units`); a difference is then
  "not separated", never better/worse or a named cause;
- :func:`min_draws`: the fewest draws (``n_boot``) a ``level`` interval can be read from (:func:`check_n_boot`);
- :func:`check_seed`: the seed is an int that ``torch.Generator.manual_seed`` takes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlalign_verl.measure.metrics import sorted_quantiles
from rlalign_verl.measure.tensor_inputs import check_int, check_number, check_tensor, input_error
from rlalign_verl.request.spec import MIN_VERIFY_SEQS

__all__ = [
    "MIN_UNITS",
    "TAIL_DRAWS",
    "enough_units",
    "min_draws",
    "check_level",
    "check_seed",
    "check_n_boot",
    "resampled_sums",
    "percentile_interval",
    "ratio_interval",
]

CHUNK_ELEMENTS = 1 << 22
"""Draws are made this many indices at a time (the same draws as one big call: the CPU generator is serial)."""

MIN_UNITS = MIN_VERIFY_SEQS  # 8: the request refuses a verify.max_seqs below it
"""Fewest independent units (sequences) a bootstrap interval may decide on. With ``n`` units a draw is one of
``C(2n-1, n)`` multisets: 1 at n=1 (every draw equal: a zero-width interval), 3 at 2, 1716 at 7, 6435 at 8 —
8 is the fewest whose draws take more distinct values than the 5000 (:func:`min_draws`) a 99.9% decision
interval is read from, so below it the interval's ends sit on a handful of repeated values, not on the spread of
the units. 8 units that all differ in one direction are also what the distribution-free sign test needs at 1%
(2^-7 = 0.8%, two-sided). The doctor's verdicts have always needed 8 sequences; ``verify`` uses the same rule."""

TAIL_DRAWS = 2.5
"""Draws expected beyond each end of an interval read from the draws (the doctor's 100 draws at 95%)."""

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def enough_units(units: int) -> bool:
    """Whether ``units`` independent units carry an interval to decide on (``>=`` :data:`MIN_UNITS`)."""
    return units >= MIN_UNITS


def _pct(level: float) -> str:
    return f"{level * 100:g}%"


def min_draws(level: float) -> int:
    """The fewest bootstrap draws a central ``level`` interval can be read from: :data:`TAIL_DRAWS` expected beyond
    each end, so that neither end is the single most extreme draw (95%: 100; 99.9%: 5000)."""
    return math.ceil(round(2 * TAIL_DRAWS / (1 - level), 6))


def check_level(where: str, level: Any) -> float:
    """``level`` as a float strictly between 0 and 1."""
    out = check_number(where, "level", level, low=0.0, high=1.0, hint=", e.g. level=0.95")
    if out in (0.0, 1.0):
        raise input_error(where, f"level={out:g} leaves no interval; give a level strictly between 0 and 1, "
                          "e.g. level=0.95")  # fmt: skip
    return out


def check_seed(where: str, seed: Any, name: str = "seed") -> int:
    """``seed`` as an ``int`` that seeds a ``torch.Generator`` (not a bool, a str, ``None`` or a float)."""
    lo, hi = _SEED_RANGE
    out = check_int(where, name, seed, hint=" that seeds the bootstrap, e.g. seed=0")
    if not lo <= out <= hi:
        raise input_error(where, f"{name}={out} is out of a generator seed's range; give an int in "
                          f"[-2**63, 2**64 - 1], e.g. {name}=0")  # fmt: skip
    return out


def check_n_boot(where: str, n_boot: Any, level: float, default: int | None = None) -> int:
    """``n_boot`` as an int of at least :func:`min_draws` ``(level)`` draws."""
    need = min_draws(level)
    why = f": a {_pct(level)} interval needs {TAIL_DRAWS:g} draws beyond each end"
    return check_int(where, "n_boot", n_boot, minimum=need,
                     hint=why + ("" if default is None else f" (default {default})"))  # fmt: skip


def resampled_sums(columns: torch.Tensor, *, seed: int, n_boot: int) -> torch.Tensor:
    """``[K, n_boot]``: for each of ``n_boot`` draws of the ``U`` units with replacement, each of the ``K``
    rows of ``columns`` (``[K, U]``, per-unit sums) summed over the drawn units, in float64."""
    where = "intervals.resampled_sums"
    check_tensor(where, "columns", columns, what="per-unit sums")
    if columns.ndim != 2 or columns.shape[1] == 0:
        raise input_error(where, f"columns has shape {tuple(columns.shape)}; give [K, U] per-unit sums of U >= 1 "
                          "units")  # fmt: skip
    seed = check_seed(where, seed)
    n_boot = check_int(where, "n_boot", n_boot, minimum=1)
    columns = columns.to("cpu", torch.float64)
    units = columns.shape[1]
    gen = torch.Generator().manual_seed(seed)
    block, out = max(1, CHUNK_ELEMENTS // max(1, units)), []
    for start in range(0, n_boot, block):
        idx = torch.randint(0, units, (min(block, n_boot - start), units), generator=gen)
        out.append(columns[:, idx].sum(-1))
    return torch.cat(out, dim=1)


def percentile_interval(draws: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of ``draws`` (linear interpolation, as ``torch.quantile``);
    at least :func:`min_draws` ``(level)`` of them."""
    where = "intervals.percentile_interval"
    level = check_level(where, level)
    check_tensor(where, "draws", draws, what="bootstrap draws")
    if draws.numel() < min_draws(level):
        raise input_error(where, f"{draws.numel()} draws are too few for a {_pct(level)} interval; draw at least "
                          f"{min_draws(level)} (n_boot): {TAIL_DRAWS:g} beyond each end")  # fmt: skip
    lo, hi = sorted_quantiles(draws.reshape(-1), ((1 - level) / 2, (1 + level) / 2)).tolist()
    return float(lo), float(hi)


def ratio_interval(
    sums: torch.Tensor, counts: torch.Tensor, *, seed: int, n_boot: int, level: float = 0.95
) -> tuple[float, float]:
    """Interval of ``sum(sums) / sum(counts)`` resampling the units (a draw of empty units counts as 1 token)."""
    where = "intervals.ratio_interval"
    check_n_boot(where, n_boot, check_level(where, level))
    for name, value in (("sums", sums), ("counts", counts)):
        check_tensor(where, name, value, what="per-unit sums")
    if sums.numel() != counts.numel():
        raise input_error(where, f"{sums.numel()} sums but {counts.numel()} counts; give one count per unit")
    s, n = resampled_sums(torch.stack([sums.reshape(-1), counts.reshape(-1)]), seed=seed, n_boot=n_boot)
    return percentile_interval(s / n.clamp_min(1), level)
