"""95% intervals for ``diagnose``: a seeded bootstrap over prompts.

A prompt (all the responses sampled for it, across ``--seeds``) is the resampling unit, since tokens
of one response are not independent. Every setting is resampled with the same prompt draws (the
same seed), so their intervals are comparable. Intervals are percentile intervals of the token-mean.
"""

from __future__ import annotations

from typing import Any

import torch

from rlalign_verl.measure.intervals import ratio_interval

N_BOOT = 2000
CI_KEYS = ("mismatch/logp_abs_diff_mean", "mismatch/kl_k3")


def prompt_groups(rollouts: list) -> list[int]:
    """Group index per rollout: rollouts with the same prompt ids share one group."""
    index: dict[tuple[int, ...], int] = {}
    return [index.setdefault(tuple(r.prompt_ids), len(index)) for r in rollouts]


def _group_sums(values: list[torch.Tensor], groups: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(groups) + 1
    sums = torch.zeros(n, dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.float64)
    for v, g in zip(values, groups, strict=True):
        sums[g] += v.sum()
        counts[g] += v.numel()
    return sums, counts


def bootstrap_ci(
    sums: torch.Tensor, counts: torch.Tensor, *, seed: int = 0, n_boot: int = N_BOOT
) -> list[float]:
    """95% percentile interval of ``sum(sums) / sum(counts)`` resampling groups with replacement."""
    return list(ratio_interval(sums, counts, seed=seed, n_boot=n_boot))


def intervals(train: list[torch.Tensor], rollouts: list, groups: list[int], seed: int = 0) -> dict[str, Any]:
    """``{metric key: [lo, hi]}`` for mean |Δlogp| and the k3 KL estimator (same definitions as metrics)."""
    from rlalign_verl.measure.metrics import MAX_LOG_RATIO

    abs_d, k3 = [], []
    for t, r in zip(train, rollouts, strict=True):
        d = t.double() - torch.tensor(r.response_logprobs, dtype=torch.float64)
        d = d[torch.isfinite(d)]
        abs_d.append(d.abs())
        k3.append(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() - 1.0 - d)
    return {
        CI_KEYS[0]: bootstrap_ci(*_group_sums(abs_d, groups), seed=seed),
        CI_KEYS[1]: bootstrap_ci(*_group_sums(k3, groups), seed=seed),
    }


def interval(row: dict[str, Any], key: str = CI_KEYS[0]) -> tuple[float, float]:
    """A row's 95% interval for ``key``; a row without one (hand-made) is its point value."""
    ci = (row.get("ci95") or {}).get(key)
    return (ci[0], ci[1]) if ci else (row[key], row[key])


def separated(a: dict[str, Any], b: dict[str, Any], key: str = CI_KEYS[0]) -> bool:
    """Whether the 95% intervals of two rows do not overlap."""
    (alo, ahi), (blo, bhi) = interval(a, key), interval(b, key)
    return ahi < blo or bhi < alo
