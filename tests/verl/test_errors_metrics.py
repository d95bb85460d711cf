"""Bad metric inputs and hostile values: one row per input -> exception type / message fragment, and the
trainer callback's promise (only finite Python floats, only under ``mismatch/``, verl's keys untouched)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from rlalign_verl.base.errors import AlignmentError, MetricsInputError, one_line
from rlalign_verl.measure.metrics import compute_mismatch_metrics

Z = torch.zeros(2, 3)
ONES = torch.ones(2, 3)

# id -> (args, kwargs, fragment of the one-line message)
BAD = {
    "train a list": (([[0.0] * 3] * 2, Z, ONES), {}, "torch.as_tensor(train_log_probs)"),
    "rollout a numpy array": ((Z, np.zeros((2, 3)), ONES), {}, "torch.as_tensor(rollout_log_probs)"),
    "mask a list": ((Z, Z, [[1, 1, 1]] * 2), {}, "torch.as_tensor(response_mask)"),
    "train None": ((None, Z, ONES), {}, "NoneType, not a torch.Tensor"),
    "clip_ratio=None": ((Z, Z, ONES), {"clip_ratio": None}, "clip_ratio=0.2"),
    "clip_ratio a string": ((Z, Z, ONES), {"clip_ratio": "0.2"}, "clip_ratio='0.2' is not a finite number"),
    "clip_ratio negative": ((Z, Z, ONES), {"clip_ratio": -0.1}, "clip_ratio=0.2"),
    "clip_ratio_high nan": ((Z, Z, ONES), {"clip_ratio_high": math.nan}, "clip_ratio_high=0.2"),
    "clip_ratio_low bool": ((Z, Z, ONES), {"clip_ratio_low": True}, "clip_ratio_low=0.2"),
    "1-D tensors": ((torch.zeros(6), torch.zeros(6), torch.ones(6)), {}, "[batch, response_len] shape"),
    "shapes differ": ((Z, torch.zeros(2, 4), ONES), {}, "got (2, 3), (2, 4) and (2, 3)"),
    "complex log-probs": ((Z.to(torch.complex64), Z, ONES), {}, "pass real log-probs"),
    "meta tensor": ((torch.zeros(2, 3, device="meta"), Z, ONES), {}, "holding data"),
    # well-typed but impossible: refused, never counted (a 0.5 / -1 / NaN mask entry is not "a response token")
    "mask 0.5": ((Z, Z, torch.full((2, 3), 0.5)), {}, "response_mask has 6 value(s) other than 0 and 1"),
    "mask -1": ((Z, Z, -ONES), {}, "other than 0 and 1"),
    "mask NaN": ((Z, Z, torch.tensor([[1.0, math.nan, 1.0]] * 2)), {}, "2 value(s) other than 0 and 1"),
    "integer mask 2": ((Z, Z, torch.full((2, 3), 2)), {}, "other than 0 and 1"),
    "integer log-probs": ((Z.long(), Z, ONES), {}, "train_log_probs is a int64 tensor"),
    "bool log-probs": ((Z, Z.bool(), ONES), {}, "rollout_log_probs is a bool tensor"),
    "positive log-probs 1e4": (
        (torch.tensor([[1e4, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2)),
        {},
        "train_log_probs has values up to 1e+04 > 0",
    ),  # fmt: skip
    "probabilities, not log-probs": (
        (Z - 0.5, torch.full((2, 3), 0.7), ONES),
        {},
        "rollout_log_probs has values up to 0.7",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_metric_input_is_a_typed_one_line_error(case):
    args, kwargs, fragment = BAD[case]
    with pytest.raises(MetricsInputError) as info:
        compute_mismatch_metrics(*args, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AlignmentError)
    line = one_line(info.value)
    assert fragment in line and "\n" not in line, line


# Hostile but well-typed values: every output value finite, statistics still right where representable.
EXTREME = {
    "float64 -1e200 vs 0": (torch.tensor([[-1e200, -0.5]], dtype=torch.float64), torch.tensor([[0.0, -0.5]])),
    "float64 -1e308 vs 0 (the square overflows)": (
        torch.tensor([[-1e308, 0.0]], dtype=torch.float64),
        torch.tensor([[0.0, 0.0]], dtype=torch.float64),
    ),
    "-float32 max": (torch.tensor([[-torch.finfo(torch.float32).max, 0.0]]), torch.tensor([[-1.0, 0.0]])),
}


def test_positive_values_outside_the_mask_are_ignored():
    """Padding may hold anything: only response tokens must be log-probs."""
    train = torch.tensor([[-0.5, 7.0]])
    out = compute_mismatch_metrics(train, torch.tensor([[-0.4, 3.0]]), torch.tensor([[1, 0]]))
    assert out["mismatch/num_tokens"] == 1 and out["mismatch/logp_abs_diff_mean"] == pytest.approx(0.1)


@pytest.mark.parametrize("case", list(EXTREME))
def test_extreme_values_give_finite_metrics(case):
    train, rollout = EXTREME[case]
    out = compute_mismatch_metrics(train, rollout, torch.ones(train.shape))
    bad = {k: v for k, v in out.items() if not math.isfinite(v)}
    assert not bad, bad
    assert out["mismatch/num_tokens"] == 2
    assert out["mismatch/kl_k2"] > 1e6  # huge, but a number every logger can store


def test_kl_k2_is_exact_below_the_clamp():
    d = 1e30  # d^2 = 1e60: no clamping, the estimator is exact
    out = compute_mismatch_metrics(
        torch.tensor([[-d, 0.0]], dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
    )
    assert out["mismatch/kl_k2"] == pytest.approx(0.5 * d * d / 2, rel=1e-12)


# --- the trainer callback's output -------------------------------------------------------------------

tc = pytest.importorskip("rlalign_verl.verl.trainer_callback")

# id -> (metrics as something produced them, what verl's loggers may see)
LOGGABLE = {
    "0-d tensors become floats": ({"mismatch/a": torch.tensor(0.5)}, {"mismatch/a": 0.5}),
    "numpy and int counts become floats": ({"mismatch/n": np.int64(3), "mismatch/m": 2}, {"mismatch/n": 3.0, "mismatch/m": 2.0}),
    "non-finite dropped": ({"mismatch/x": math.inf, "mismatch/y": torch.tensor(math.nan), "mismatch/z": 1.0}, {"mismatch/z": 1.0}),
    "keys outside mismatch/ dropped": ({"training/rollout_probs_diff_mean": 9.0, "mismatch/z": 1.0}, {"mismatch/z": 1.0}),
    "non-numbers dropped": ({"mismatch/s": "high", "mismatch/t": torch.zeros(3), "mismatch/z": 2}, {"mismatch/z": 2.0}),
}  # fmt: skip


@pytest.fixture
def plugin_log(caplog):
    """Records of the plugin's logger (it does not propagate to the root logger caplog listens on)."""
    plugin_logger = logging.getLogger("rlalign_verl.verl")
    plugin_logger.addHandler(caplog.handler)
    yield caplog
    plugin_logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("case", list(LOGGABLE))
def test_callback_emits_only_finite_python_floats_under_mismatch(case, plugin_log):
    given, want = LOGGABLE[case]
    got = tc.loggable(given)
    caplog = plugin_log
    assert got == want
    assert all(type(v) is float for v in got.values())
    assert (len(given) != len(want)) == any("dropped" in r.getMessage() for r in caplog.records)


def test_hook_never_overwrites_verl_keys(monkeypatch):
    """verl's own result keys survive, even a colliding key the plugin would produce."""
    verl_result = {"training/rollout_probs_diff_mean": 0.25, "mismatch/num_tokens": 7.0}

    def original(data, *a, **k):
        return dict(verl_result)

    ours = {
        "mismatch/num_tokens": 99,
        "training/rollout_probs_diff_mean": 1.0,
        "mismatch/kl_k1": torch.tensor(0.1),
    }
    monkeypatch.setattr(tc, "step_mismatch_metrics", lambda data, config: ours)
    hook = tc._wrap_hook(original)
    from rlalign_verl.request.spec import AlignmentSpec
    from rlalign_verl.verl.run_context import Run, running

    with running(Run({"alignment": {"metrics": True}}, AlignmentSpec(), trainer=None, legacy=False)):
        out = hook(object())
    assert out["training/rollout_probs_diff_mean"] == 0.25 and out["mismatch/num_tokens"] == 7.0
    assert out["mismatch/kl_k1"] == pytest.approx(0.1) and type(out["mismatch/kl_k1"]) is float
