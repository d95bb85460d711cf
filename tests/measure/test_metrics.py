"""compute_mismatch_metrics against hand-computed values on small tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlalign_verl.measure.metrics import COUNT_NAMES, METRIC_NAMES, compute_mismatch_metrics, sorted_quantiles

NAN, INF = float("nan"), float("inf")

# Row 0: last token padded. Row 1: a NaN and an inf inside the mask. Row 2: all masked (NaN in padding
# must not count). Row 3: one valid token.
TRAIN = [
    [-1.0, -2.0, -0.5, -7.0],
    [-0.1, NAN, -3.0, -1.0],
    [NAN, -1.0, -1.0, -1.0],
    [-2.0, -9.0, -9.0, -9.0],
]
ROLLOUT = [
    [-1.1, -1.5, -0.5, -0.2],
    [-0.3, -1.0, -2.0, -INF],
    [-1.0, -1.0, -1.0, -1.0],
    [-2.0, 0.0, 0.0, 0.0],
]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
# The valid (train, rollout) pairs, by hand, and the per-sequence groups.
PAIRS = [(-1.0, -1.1), (-2.0, -1.5), (-0.5, -0.5), (-0.1, -0.3), (-3.0, -2.0), (-2.0, -2.0)]
SEQS = [[0, 1, 2], [3, 4], [5]]


def _tensors(dtype=torch.float64, mask_dtype=torch.int64):
    return (
        torch.tensor(TRAIN, dtype=dtype),
        torch.tensor(ROLLOUT, dtype=dtype),
        torch.tensor(MASK, dtype=mask_dtype),
    )


def _expected(pairs, seqs, eps_low=0.2, eps_high=0.2):
    d = [t - r for t, r in pairs]
    n = len(d)
    ratio = [math.exp(x) for x in d]
    abs_d = sorted(abs(x) for x in d)

    def q(p):  # linear interpolation, written out
        pos = p * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return abs_d[lo] + (abs_d[hi] - abs_d[lo]) * (pos - lo)

    seq_abs = [abs(sum(d[i] for i in s)) for s in seqs]
    prob = [abs(math.exp(t) - math.exp(r)) for t, r in pairs]
    return {
        "logp_abs_diff_mean": sum(abs_d) / n,
        "logp_abs_diff_max": max(abs_d),
        "logp_abs_diff_p50": q(0.5),
        "logp_abs_diff_p90": q(0.9),
        "logp_abs_diff_p99": q(0.99),
        "kl_k1": sum(-x for x in d) / n,
        "kl_k2": sum(0.5 * x * x for x in d) / n,
        "kl_k3": sum(math.exp(x) - 1 - x for x in d) / n,
        "prob_abs_diff_mean": sum(prob) / n,
        "prob_abs_diff_max": max(prob),
        "ratio_mean": sum(ratio) / n,
        "ratio_min": min(ratio),
        "ratio_max": max(ratio),
        "ratio_clip_frac": sum(1 for r in ratio if r < 1 - eps_low or r > 1 + eps_high) / n,
        "seq_log_ratio_abs_mean": sum(seq_abs) / len(seq_abs),
        "seq_log_ratio_abs_max": max(seq_abs),
    }


def test_values_match_hand_computation_with_masks_nan_inf_and_empty_rows():
    out = compute_mismatch_metrics(*_tensors())
    assert set(out) == {f"mismatch/{k}" for k in METRIC_NAMES + COUNT_NAMES}
    assert out["mismatch/num_tokens"] == 6
    assert out["mismatch/num_seqs"] == 3  # the all-masked row is not a sequence
    assert out["mismatch/nonfinite_tokens"] == 2  # NaN and -inf inside the mask; masked NaN not counted
    for key, want in _expected(PAIRS, SEQS).items():
        assert out[f"mismatch/{key}"] == pytest.approx(want, rel=1e-12, abs=1e-15), key
    # A few of the same numbers written out completely, to pin the definitions down.
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx((0.1 + 0.5 + 0 + 0.2 + 1.0 + 0) / 6)
    assert out["mismatch/kl_k1"] == pytest.approx(1.2 / 6)
    assert out["mismatch/ratio_clip_frac"] == pytest.approx(3 / 6)  # e^-0.5, e^0.2 and e^-1 are outside
    assert out["mismatch/ratio_min"] == pytest.approx(math.exp(-1.0))
    assert out["mismatch/seq_log_ratio_abs_mean"] == pytest.approx((0.4 + 0.8 + 0.0) / 3)
    assert out["mismatch/logp_abs_diff_p50"] == pytest.approx(0.15)
    assert out["mismatch/logp_abs_diff_p99"] == pytest.approx(0.975)


def test_asymmetric_clip_range_and_prefix():
    out = compute_mismatch_metrics(
        *_tensors(), clip_ratio=0.9, clip_ratio_low=0.5, clip_ratio_high=0.3, prefix="x/"
    )
    assert out["x/ratio_clip_frac"] == pytest.approx(1 / 6)  # only e^-1 < 0.5
    assert out["x/ratio_clip_frac"] == pytest.approx(_expected(PAIRS, SEQS, 0.5, 0.3)["ratio_clip_frac"])
    assert all(k.startswith("x/") for k in out)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.float32])
def test_mask_dtypes_give_same_result(mask_dtype):
    ref = compute_mismatch_metrics(*_tensors())
    assert compute_mismatch_metrics(*_tensors(mask_dtype=mask_dtype)) == ref


def test_quantiles_can_be_switched_off():
    out = compute_mismatch_metrics(*_tensors(), quantiles=False)
    assert not any("_p50" in k or "_p90" in k or "_p99" in k for k in out)
    assert out["mismatch/kl_k3"] == compute_mismatch_metrics(*_tensors())["mismatch/kl_k3"]


def test_bf16_inputs_are_reduced_in_high_precision():
    # Values exactly representable in bf16; d = 1/16 per token.
    train = torch.tensor([[-8.0, -0.5, -1.0]], dtype=torch.bfloat16)
    rollout = torch.tensor([[-8.0625, -0.5625, -1.0625]], dtype=torch.bfloat16)
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = compute_mismatch_metrics(train, rollout, mask)
    d = 0.0625
    # In bf16 exp(1/16) rounds to 1.0625 and k3 would come out 0.
    assert out["mismatch/kl_k3"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-12)
    assert out["mismatch/kl_k3"] > 1.9e-3
    assert out["mismatch/ratio_mean"] == pytest.approx(math.exp(d), rel=1e-12)
    assert out["mismatch/seq_log_ratio_abs_max"] == pytest.approx(3 * d, rel=1e-12)
    want_prob = max(abs(math.exp(t) - math.exp(t - d)) for t in (-8.0, -0.5, -1.0))
    assert out["mismatch/prob_abs_diff_max"] == pytest.approx(want_prob, rel=1e-12)
    assert all(isinstance(v, float) for k, v in out.items() if k.split("/")[1] in METRIC_NAMES)


@pytest.mark.parametrize(
    "shape_mask",
    [
        ((2, 5), torch.zeros(2, 5)),  # all masked
        ((0, 5), torch.zeros(0, 5)),  # no rows
        ((3, 0), torch.zeros(3, 0)),  # no columns
    ],
)
def test_empty_returns_only_counts(shape_mask):
    shape, mask = shape_mask
    out = compute_mismatch_metrics(torch.zeros(shape), torch.zeros(shape), mask)
    assert out == {"mismatch/num_tokens": 0, "mismatch/num_seqs": 0, "mismatch/nonfinite_tokens": 0}


def test_all_nonfinite_counts_and_no_statistics():
    train = torch.tensor([[NAN, INF], [-INF, NAN]])
    out = compute_mismatch_metrics(train, torch.zeros(2, 2), torch.ones(2, 2))
    assert out == {"mismatch/num_tokens": 0, "mismatch/num_seqs": 0, "mismatch/nonfinite_tokens": 4}


def test_extreme_log_ratio_stays_finite():
    train = torch.tensor([[-0.1, -0.2]])
    rollout = torch.tensor([[-9999.0, -0.2]])  # some engines report -9999 for "impossible" tokens
    out = compute_mismatch_metrics(train, rollout, torch.ones(1, 2))
    assert all(math.isfinite(v) for v in out.values())
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(9998.9, rel=1e-6)
    assert out["mismatch/ratio_max"] == pytest.approx(math.exp(300.0))
    assert out["mismatch/ratio_clip_frac"] == 0.5


@pytest.mark.parametrize(
    "shapes",
    [((2, 3), (2, 3), (2, 4)), ((2, 3), (3, 3), (2, 3)), ((6,), (6,), (6,)), ((1, 2, 3),) * 3],
)
def test_bad_shapes_raise_clear_value_error(shapes):
    a, b, m = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=r"\[batch, response_len\] shape"):
        compute_mismatch_metrics(a, b, m)


def test_sorted_quantiles_matches_torch_quantile():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1001, generator=g, dtype=torch.float64)
    qs = (0.0, 0.25, 0.5, 0.9, 0.99, 1.0)
    got = sorted_quantiles(x, qs)
    want = torch.quantile(x, torch.tensor(qs, dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert sorted_quantiles(torch.tensor([3.0]), (0.5, 0.99)).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError):
        sorted_quantiles(torch.tensor([]), (0.5,))


@pytest.mark.slow
def test_sorted_quantiles_above_torch_quantile_limit():
    n = (1 << 24) + 3  # torch.quantile raises "input tensor is too large" above 16M elements
    x = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    got = sorted_quantiles(x, (0.5, 0.99)).tolist()
    want = np.quantile(x.numpy(), [0.5, 0.99])
    assert got == pytest.approx(want.tolist(), rel=1e-6)


def test_full_size_batch_against_numpy():
    g = torch.Generator().manual_seed(2)
    shape = (256, 4096)
    rollout = -torch.rand(shape, generator=g) * 5
    train = (
        (rollout + 0.01 * torch.randn(shape, generator=g)).clamp(max=0).to(torch.bfloat16)
    )  # log-probs: <= 0
    lengths = torch.randint(0, 4097, (256,), generator=g)
    mask = torch.arange(4096)[None, :] < lengths[:, None]
    out = compute_mismatch_metrics(train, rollout, mask)

    t = train.double().numpy()[mask.numpy()]
    r = rollout.double().numpy()[mask.numpy()]
    d = t - r
    assert out["mismatch/num_tokens"] == int(lengths.sum())
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(np.abs(d).mean(), rel=1e-9)
    assert out["mismatch/logp_abs_diff_p90"] == pytest.approx(np.quantile(np.abs(d), 0.9), rel=1e-9)
    assert out["mismatch/kl_k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-9)
    assert out["mismatch/ratio_max"] == pytest.approx(np.exp(d).max(), rel=1e-12)
