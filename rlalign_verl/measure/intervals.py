"""The one bootstrap: seeded resampling of independent units (sequences, prompts) and percentile intervals.

Tokens of one response are not independent, so the unit is a sequence (the doctor, the step-1 verify) or a
prompt with all its responses (``diagnose``). Statistics are ratios of sums over the drawn units (a token mean is
``sum of |Δ| / sum of token counts``); every statistic of one call is computed on the same draws, so paired
differences (aligned vs unaligned, one ladder rung vs the previous) keep their pairing.
"""

from __future__ import annotations

import torch

from rlalign_verl.measure.metrics import sorted_quantiles

CHUNK_ELEMENTS = 1 << 22
"""Draws are made this many indices at a time (the same draws as one big call: the CPU generator is serial)."""


def resampled_sums(columns: torch.Tensor, *, seed: int, n_boot: int) -> torch.Tensor:
    """``[K, n_boot]``: for each of ``n_boot`` draws of the ``U`` units with replacement, each of the ``K``
    rows of ``columns`` (``[K, U]``, per-unit sums) summed over the drawn units, in float64."""
    columns = columns.to("cpu", torch.float64)
    units = columns.shape[1]
    gen = torch.Generator().manual_seed(seed)
    block, out = max(1, CHUNK_ELEMENTS // max(1, units)), []
    for start in range(0, n_boot, block):
        idx = torch.randint(0, units, (min(block, n_boot - start), units), generator=gen)
        out.append(columns[:, idx].sum(-1))
    return torch.cat(out, dim=1)


def percentile_interval(draws: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of ``draws`` (linear interpolation, as ``torch.quantile``)."""
    lo, hi = sorted_quantiles(draws.reshape(-1), ((1 - level) / 2, (1 + level) / 2)).tolist()
    return float(lo), float(hi)


def ratio_interval(
    sums: torch.Tensor, counts: torch.Tensor, *, seed: int, n_boot: int, level: float = 0.95
) -> tuple[float, float]:
    """Interval of ``sum(sums) / sum(counts)`` resampling the units (a draw of empty units counts as 1 token)."""
    s, n = resampled_sums(torch.stack([sums.reshape(-1), counts.reshape(-1)]), seed=seed, n_boot=n_boot)
    return percentile_interval(s / n.clamp_min(1), level)
