"""The in-run verification's statistics and verdict policy on known inputs (rlalign_verl.measure.verify / verify_policy)."""

from __future__ import annotations

import math

import pytest
import torch

from rlalign_verl.base.options import spelled_as
from rlalign_verl.measure.intervals import MIN_UNITS
from rlalign_verl.measure.verify import GAIN_CAP, VerifyFailedError, compare
from rlalign_verl.measure.verify_policy import act_on
from rlalign_verl.request.spec import AlignmentSpec


def _passes(seed: int, seqs: int, aligned_scale: float, tokens: int = 24):
    """Rollout log-probs and two trainer passes whose per-token errors are ``aligned_scale`` : 1 in size."""
    g = torch.Generator().manual_seed(seed)
    rollout = -(0.1 + 3 * torch.rand(seqs, tokens, generator=g, dtype=torch.float64))
    noise = torch.randn(seqs, tokens, generator=g, dtype=torch.float64) * 0.05
    unaligned = rollout + noise
    aligned = rollout + aligned_scale * noise * torch.rand(seqs, tokens, generator=g, dtype=torch.float64) * 2
    # log-probs are <= 0 (compare refuses positive ones): the few tokens the noise pushes above 0 stay at 0
    return aligned.clamp(max=0.0), unaligned.clamp(max=0.0), rollout, torch.ones(seqs, tokens)


def test_identical_passes_are_within_noise_with_gain_one() -> None:
    a, _, r, m = _passes(0, 16, 0.6)
    res = compare(a, a.clone(), r, m)
    assert res.verdict == 0 and res.gain == 1.0 and res.paired_diff == 0.0
    assert res.gain_ci == (1.0, 1.0)


def test_exact_aligned_gap_caps_the_gain_and_says_better() -> None:
    _, u, r, m = _passes(1, 16, 0.6)
    res = compare(r.clone(), u, r, m)
    assert res.aligned == 0.0 and res.aligned_exact == 1.0 and res.unaligned_exact == 0.0
    assert res.gain == GAIN_CAP and res.verdict == 1


def test_the_means_are_token_weighted_over_the_mask() -> None:
    a, u, r, m = _passes(2, 4, 0.5, tokens=6)
    m[1, 3:] = 0
    m[3, 1:] = 0
    res = compare(a, u, r, m)
    keep = m > 0
    assert res.aligned == pytest.approx(float((a - r).abs()[keep].mean()), rel=1e-12)
    assert res.unaligned == pytest.approx(float((u - r).abs()[keep].mean()), rel=1e-12)
    assert res.num_tokens == int(keep.sum()) and res.num_seqs == 4
    # masked-out positions do not count, whatever they hold (NaN included)
    a2 = a.clone()
    a2[~keep] = float("nan")
    assert compare(a2, u, r, m) == res


def test_a_clearly_worse_profile_is_minus_one_and_stops_with_the_fix_spelled_per_surface() -> None:
    a, u, r, m = _passes(3, 16, 3.0)  # the "aligned" pass is ~3x farther from the rollout
    res = compare(a, u, r, m)
    assert res.verdict == -1 and res.gain_ci[1] < 1.0
    spec = AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm"})
    with pytest.raises(VerifyFailedError, match=r"alignment\.verify\.on_worse=warn to continue"):
        act_on(res, first=True, spec=spec, fingerprint="vllm 0.31.0 (compiled) on cuda")
    with pytest.raises(VerifyFailedError, match=r"--alignment\.verify\.on_worse warn to continue"):
        with spelled_as("flag"):
            act_on(res, first=True, spec=spec, fingerprint="vllm")
    # later steps warn by default, naming the key that would stop them
    line = act_on(res, first=False, spec=spec, fingerprint="vllm")
    assert line is not None and "alignment.verify.on_worse_later=warn" in line
    assert (
        act_on(compare(u, a, r, m), first=True, spec=spec, fingerprint="vllm") is None
    )  # better: nothing to do


def test_the_verdict_uses_the_wider_interval() -> None:
    """Few sequences (the fewest that carry an interval): the 95% interval of the gain can exclude 1 while the
    99.9% decision interval does not — the verdict then says "within noise", and the logged line says which
    interval decides."""
    found = None
    for seed in range(200):
        res = compare(*_passes(seed, MIN_UNITS, 0.75, tokens=8))
        if res.gain_ci[0] > 1.0 and res.verdict == 0:
            found = res
            break
    assert found is not None, "no small sample separated at 95% but not at 99.9%"
    lo, hi = found.decision_ci
    assert lo <= found.paired_diff_ci[0] and hi >= found.paired_diff_ci[1] and lo <= 0.0
    assert "99.9%" in found.line(1, "vllm") and "within noise" in found.line(1, "vllm")


def test_every_reported_number_is_finite_or_left_out() -> None:
    a, u, r, m = _passes(4, 8, 0.5)
    a[0, 0] = float("inf")  # a non-finite token is left out, not propagated
    res = compare(a, u, r, m)
    assert res.num_tokens == m.numel() - 1
    assert all(math.isfinite(v) for v in res.metrics().values())
    with pytest.raises(ValueError, match="no valid response token"):
        compare(a, u, r, torch.zeros_like(m))
