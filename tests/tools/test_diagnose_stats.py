"""The numbers behind the diagnose table: bootstrap intervals over prompts and the tie/floor rules."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign_verl.tools.diagnose.recommend import floor_relation, recommend
from rlalign_verl.tools.diagnose.rollouts import Rollout
from rlalign_verl.tools.diagnose.stats import bootstrap_ci, intervals, prompt_groups

MEAN = "mismatch/logp_abs_diff_mean"


def test_prompt_groups_pool_repeats_of_a_prompt():
    rs = [Rollout([1, 2], [3], [-1.0]), Rollout([4], [3], [-1.0]), Rollout([1, 2], [5], [-1.0])]
    assert prompt_groups(rs) == [0, 1, 0]


def test_bootstrap_interval_is_seeded_and_covers_the_mean():
    gen = torch.Generator().manual_seed(1)
    sums = torch.rand(64, generator=gen, dtype=torch.float64) * 10
    counts = torch.full((64,), 10.0, dtype=torch.float64)
    lo, hi = bootstrap_ci(sums, counts, seed=3)
    assert bootstrap_ci(sums, counts, seed=3) == [lo, hi]  # same seed, same interval
    mean = float(sums.sum() / counts.sum())
    assert lo < mean < hi
    # the width shrinks like 1/sqrt(n): 4x the prompts, about half the width
    lo4, hi4 = bootstrap_ci(sums.repeat(4), counts.repeat(4), seed=3)
    assert 0.35 < (hi4 - lo4) / (hi - lo) < 0.65


def test_a_constant_gap_has_a_zero_width_interval():
    sums = torch.full((8,), 2.0, dtype=torch.float64)
    counts = torch.full((8,), 4.0, dtype=torch.float64)
    assert bootstrap_ci(sums, counts) == [0.5, 0.5]


def test_intervals_use_the_metric_definitions():
    """|d| and k3 = exp(d) - 1 - d per token, token-mean per resample; checked against the exact values."""
    d = 0.1
    rs = [Rollout([i], [7, 8], [-1.0, -2.0]) for i in range(5)]
    train = [torch.tensor([-1.0 + d, -2.0 + d]) for _ in rs]
    ci = intervals(train, rs, prompt_groups(rs))
    assert ci[MEAN] == pytest.approx([d, d], abs=1e-6)
    k3 = math.exp(d) - 1 - d
    assert ci["mismatch/kl_k3"] == pytest.approx([k3, k3], rel=1e-4)


def _row(mean, regions, lo=None, hi=None):
    r = {MEAN: mean, "regions": list(regions)}
    if lo is not None:
        r["ci95"] = {MEAN: [lo, hi]}
    return r


def test_overlapping_intervals_name_the_cheaper_setting():
    res = {
        "none": _row(0.10, (), 0.095, 0.105),
        "rmsnorm": _row(0.066, ("rmsnorm",), 0.060, 0.072),  # 85%: below the 90% target on its own
        "rope+rmsnorm": _row(0.062, ("rope", "rmsnorm"), 0.057, 0.067),
        "all": _row(0.06, ("rope", "swiglu", "rmsnorm"), 0.055, 0.065),
    }
    rec = recommend(res, None)
    assert rec["setting"] == "rmsnorm" and rec["tie_with"] == "rope+rmsnorm" and "tie" in rec["text"]
    res["rmsnorm"] = _row(0.066, ("rmsnorm",), 0.0655, 0.0665)  # now separated from rope+rmsnorm
    res["rope+rmsnorm"] = _row(0.062, ("rope", "rmsnorm"), 0.0615, 0.0625)
    assert recommend(res, None)["setting"] == "rope+rmsnorm"


def test_everything_within_noise_of_none_recommends_nothing():
    res = {
        "none": _row(0.10, (), 0.08, 0.12),
        "all": _row(0.095, ("rope", "swiglu", "rmsnorm"), 0.075, 0.115),
    }
    rec = recommend(res, None)
    assert rec["regions"] == [] and "within noise" in rec["text"]


def test_below_the_floor_is_at_the_floor_not_better():
    floor = _row(0.0371, (), 0.0354, 0.0390)
    assert (
        floor_relation(_row(0.03616, ("rope", "rmsnorm"), 0.03435, 0.03811), floor)
        == "at floor (within noise)"
    )
    assert floor_relation(_row(0.05, ("rope",), 0.048, 0.052), floor) == "above floor"
    assert floor_relation(_row(0.05, ("rope",)), None) is None
