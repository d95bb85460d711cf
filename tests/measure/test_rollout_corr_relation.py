"""``mismatch/kl_k1`` / ``kl_k3`` against verl's ``rollout_corr/kl`` / ``rollout_corr/k3_kl``.

Both are computed from the same tensors: ours with :func:`rlalign_verl.measure.metrics.compute_mismatch_metrics`,
verl's with its real ``compute_offpolicy_metrics`` (``verl/trainer/ppo/rollout_corr_helper.py``), which
feeds ``rollout_corr/*`` when rollout correction is on. docs/metrics.md states the correspondence:
same estimators, same sign (both estimate KL(pi_rollout || pi_train); k1 = mean(log pi_rollout - log
pi_train)), same token set; ours is float64 and drops non-finite tokens instead of propagating them.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlalign_verl.measure.metrics import compute_mismatch_metrics

pytestmark = pytest.mark.verl


def _inputs(seed: int = 0, scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 20, generator=g, dtype=torch.float64) * 4  # log-probs in (-4, 0]
    # a log-prob stays <= 0 (the metrics refuse positive ones)
    train = (rollout + scale * torch.randn(6, 20, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.ones(6, 20)
    mask[1, 12:] = 0
    mask[4, 3:] = 0
    return train, rollout, mask


def _verl(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    return helper.compute_offpolicy_metrics(old_log_prob=train, rollout_log_prob=rollout, response_mask=mask)


@pytest.mark.parametrize("scale", [0.01, 0.3])
def test_k1_and_k3_equal_verls_kl_and_k3_kl(scale):
    train, rollout, mask = _inputs(scale=scale)
    ours = compute_mismatch_metrics(train, rollout, mask)
    theirs = _verl(train, rollout, mask)
    assert ours["mismatch/kl_k1"] == pytest.approx(theirs["kl"], rel=1e-12, abs=1e-15)
    assert ours["mismatch/kl_k3"] == pytest.approx(theirs["k3_kl"], rel=1e-12)
    # the sign: a trainer less confident than the rollout on the sampled tokens gives positive k1 in both
    lower = compute_mismatch_metrics(rollout - 0.1, rollout, mask)["mismatch/kl_k1"]
    assert lower == pytest.approx(0.1) and _verl(rollout - 0.1, rollout, mask)["kl"] == pytest.approx(0.1)


def test_bf16_inputs_verl_rounds_ours_does_not():
    train, rollout, mask = _inputs(scale=0.01)
    exact = compute_mismatch_metrics(train, rollout, mask)["mismatch/kl_k3"]
    t16, r16 = train.bfloat16(), rollout.bfloat16()
    ours = compute_mismatch_metrics(t16, r16, mask)["mismatch/kl_k3"]
    theirs = _verl(t16, r16, mask.bfloat16())["k3_kl"]
    # ours upcasts the (rounded) log-probs to float64; verl evaluates exp(d) - d - 1 in bf16
    ref = compute_mismatch_metrics(t16.double(), r16.double(), mask)["mismatch/kl_k3"]
    assert ours == pytest.approx(ref, rel=1e-12)
    assert abs(theirs - ref) > 1e-3 * ref and 0 < exact


def test_non_finite_token_is_dropped_by_ours_and_poisons_verls():
    train, rollout, mask = _inputs()
    train[0, 0] = float("-inf")
    ours = compute_mismatch_metrics(train, rollout, mask)
    theirs = _verl(train, rollout, mask)
    assert ours["mismatch/nonfinite_tokens"] == 1 and math.isfinite(ours["mismatch/kl_k1"])
    assert not math.isfinite(theirs["kl"])
