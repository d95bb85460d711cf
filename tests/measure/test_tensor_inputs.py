"""One input check for every public function taking log-probs and a mask (rlalign_verl.measure.tensor_inputs).

Each hostile input goes to each entry point and must come back as the same typed error, one line naming what is
wrong and the fix; valid inputs must give the very same numbers with the check as without it; non-finite
log-probs stay data (left out and counted), as documented; the in-run callers still log and go on.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlalign_verl.base.errors import AlignmentError, MetricsInputError, one_line
from rlalign_verl.measure import doctor, metrics, tensor_inputs, verify
from rlalign_verl.measure import turns as rounds
from rlalign_verl.measure.doctor import Doctor, signatures
from rlalign_verl.measure.metrics import compute_mismatch_metrics
from rlalign_verl.measure.turns import round_index, round_metrics, unexplained_mask
from rlalign_verl.measure.verify import compare, ladder_metrics
from rlalign_verl.openrlhf.experience_metrics import step_mismatch_metrics as openrlhf_step_metrics

B, T = 6, 10


def _valid(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rounds per row (a multi-turn batch: the per-round keys run too), log-probs in [-3.1, -0.1]."""
    g = torch.Generator().manual_seed(seed)
    rollout = -(0.1 + 3 * torch.rand(B, T, generator=g, dtype=torch.float64))
    train = (rollout + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, 4:6] = 0  # the environment's tokens between the rounds
    mask[1, 8:] = 0  # padding
    return train.to(dtype), rollout.to(dtype), mask


def _experience(train, rollout, mask):
    return SimpleNamespace(action_log_probs=train, rollout_log_probs=rollout, action_mask=mask,
                           sequences=torch.zeros(2, 1), info={})  # fmt: skip


# entry point -> (call on (train, rollout, mask), the prefix of its messages)
ENTRY = {
    "compute_mismatch_metrics": (compute_mismatch_metrics, "compute_mismatch_metrics: "),
    "signatures": (signatures, "doctor.signatures: "),
    "Doctor.step": (lambda t, r, m: Doctor().step(1, t, r, m), "Doctor.step: "),
    "round_metrics": (round_metrics, "rounds.round_metrics: "),
    "compare": (lambda t, r, m: compare(t, r, r, m), "verify.compare: "),
    "ladder_metrics": (lambda t, r, m: ladder_metrics({"none": t}, r, m), "verify.ladder_metrics: "),
    "openrlhf step metrics": (lambda t, r, m: openrlhf_step_metrics([_experience(t, r, m)]), ""),
}


def _mask_with(value: float, dtype: torch.dtype = torch.float32):
    def make(t, r, m):
        m = m.to(dtype)
        m[0, 1] = value
        return t, r, m

    return make


def _set(which: int, value: float):
    def make(t, r, m):
        out = [t.clone(), r.clone(), m]
        out[which][2, 2] = value
        return tuple(out)

    return make


# hostile input -> (make it from a valid (train, rollout, mask), fragment of the message)
HOSTILE = {
    "mask 0.5": (_mask_with(0.5), "1 value(s) other than 0 and 1"),
    "mask 2 (int)": (_mask_with(2, torch.long), "other than 0 and 1"),
    "mask -1": (_mask_with(-1.0), "other than 0 and 1"),
    "mask NaN": (_mask_with(math.nan), "other than 0 and 1"),
    "token ids as log-probs": (lambda t, r, m: (torch.randint(0, 50, t.shape), r, m), "is a int64 tensor; log-probs"),
    "a bool tensor as log-probs": (lambda t, r, m: (t, r < -1, m), "is a bool tensor; log-probs"),
    "probabilities as log-probs": (lambda t, r, m: (t.exp(), r, m), "probabilities, not log-probs; pass log(p)"),
    "rollout probabilities": (lambda t, r, m: (t, r.exp(), m), "probabilities, not log-probs; pass log(p)"),
    "logits as log-probs": (lambda t, r, m: (t + 8.0, r, m), "> 0 on response tokens; log-probs are <= 0"),
    "one positive log-prob": (_set(0, 0.5), "values up to 0.5 > 0 on response tokens"),
    "shape mismatch": (lambda t, r, m: (t, r[:, :-1], m), "one [batch, response_len] shape, got"),
    "mask shape mismatch": (lambda t, r, m: (t, r, m[:-1]), "one [batch, response_len] shape, got"),
    "1-D tensors": (lambda t, r, m: (t.flatten(), r.flatten(), m.flatten()), "one [batch, response_len] shape"),
    "a list": (lambda t, r, m: (t.tolist(), r, m), "is a list, not a torch.Tensor; convert it with torch.as_tensor"),
    "a numpy mask": (lambda t, r, m: (t, r, m.numpy()), "is a ndarray, not a torch.Tensor"),
    "a None mask": (lambda t, r, m: (t, r, None), "is a NoneType, not a torch.Tensor"),
    "complex log-probs": (lambda t, r, m: (t.to(torch.complex64), r, m), "pass real log-probs holding data"),
}  # fmt: skip


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("case", list(HOSTILE))
def test_each_hostile_input_is_one_typed_line_at_each_entry_point(entry: str, case: str) -> None:
    call, prefix = ENTRY[entry]
    make, fragment = HOSTILE[case]
    with pytest.raises(MetricsInputError) as info:
        call(*make(*_valid()))
    err = info.value
    assert isinstance(err, AlignmentError) and isinstance(err, ValueError)
    text = str(err)
    assert fragment in text and "\n" not in text and text.startswith(prefix), text
    assert one_line(err).startswith("[rlalign-verl] ERROR MetricsInputError: ")


@pytest.mark.parametrize("step", ["x", 1.5, None, True, torch.tensor(1.0)])
def test_doctor_step_refuses_a_step_that_is_not_an_int(step) -> None:
    with pytest.raises(MetricsInputError, match=r"^Doctor\.step: step=.* not an int; pass the training step"):
        Doctor().step(step, *_valid())


def test_doctor_step_takes_numpy_and_tensor_ints_as_the_int() -> None:
    want = Doctor().step(3, *_valid())
    assert Doctor().step(np.int64(3), *_valid()) == want
    assert Doctor().step(torch.tensor(3), *_valid()) == want


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, math.nan])
def test_the_mask_only_functions_refuse_the_same_masks(value: float) -> None:
    _, _, m = _mask_with(value)(*_valid())
    for call, prefix in ((lambda: round_index(m), "rounds.round_index: "),
                         (lambda: unexplained_mask(m, ["rounds"]), "rounds.unexplained_mask: ")):  # fmt: skip
        with pytest.raises(MetricsInputError) as info:
            call()
        assert str(info.value).startswith(prefix) and "other than 0 and 1" in str(info.value)


def test_ids_and_groups_are_checked_in_one_place_too() -> None:
    t, r, m = _valid()
    float_ids = torch.zeros(B, T)
    with pytest.raises(MetricsInputError, match=r"^Doctor\.step: trainer_ids is float32; pass token ids"):
        Doctor().step(1, t, r, m, trainer_ids=float_ids, rollout_ids=float_ids)
    with pytest.raises(
        MetricsInputError, match=r"^rounds\.round_metrics: rollout_ids must be a \(6, 10\) token-id"
    ):
        round_metrics(t, r, m, trainer_ids=torch.zeros(B, T, dtype=torch.long), rollout_ids=[0])
    with pytest.raises(
        MetricsInputError, match=r"responses is float32; pass token ids \(batch\['responses'\]\)"
    ):
        signatures(t, r, m, uid=list(range(B)), responses=float_ids)


# --- what is not refused ------------------------------------------------------------------------------------


ACCEPTED = {
    "bool mask": lambda t, r, m: (t, r, m.bool()),
    "float mask": lambda t, r, m: (t, r, m.float()),
    "bf16 log-probs": lambda t, r, m: (t.bfloat16(), r.bfloat16(), m),
    "float64 log-probs": lambda t, r, m: (t.double(), r.double(), m),
    "log-probs exactly 0 (certain tokens)": lambda t, r, m: (torch.zeros_like(t), torch.zeros_like(r), m),
    "rounding just above 0": lambda t, r, m: (torch.full_like(t, 5e-4), r, m),
    "padding holding garbage": lambda t, r, m: (
        t.masked_fill(m == 0, 7.0),
        r.masked_fill(m == 0, math.nan),
        m,
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_valid_inputs_pass_every_entry_point(entry: str, case: str) -> None:
    call, _ = ENTRY[entry]
    call(*ACCEPTED[case](*_valid()))


@pytest.mark.parametrize("entry", [e for e in ENTRY if e != "compare"])
def test_empty_batches_pass(entry: str) -> None:
    ENTRY[entry][0](torch.zeros(0, T), torch.zeros(0, T), torch.zeros(0, T))


@pytest.mark.parametrize("value", [math.nan, -math.inf, math.inf])
def test_non_finite_log_probs_are_left_out_and_counted_not_refused(value: float) -> None:
    """A diverging trainer's NaN/inf tokens are data: refusing them would drop the step's metrics."""
    t, r, m = _set(0, value)(*_valid())
    n = int((m != 0).sum())
    assert compute_mismatch_metrics(t, r, m)["mismatch/nonfinite_tokens"] == 1
    assert compute_mismatch_metrics(t, r, m)["mismatch/num_tokens"] == n - 1
    assert signatures(t, r, m)["mismatch/doctor/nonfinite_tokens"] == 1.0
    sig, _ = Doctor().step(1, t, r, m)
    assert sig["mismatch/doctor/num_tokens"] == n - 1 and "mismatch/round_1/kl_k3" in sig
    assert compare(t, r, r, m).num_tokens == n - 1
    assert math.isfinite(ladder_metrics({"none": t}, r, m)["mismatch/verify/ladder/none"])
    assert all(math.isfinite(v) for v in round_metrics(t, r, m).values())


# --- valid inputs: the same numbers with the check as without it ---------------------------------------------


def _outputs(t, r, m):
    t0, r0, m0 = t.clone(), r.clone(), m.clone()
    out = {name: call(t, r, m) for name, (call, _) in ENTRY.items()}
    out["round_index"] = round_index(m)
    out["unexplained_mask"] = unexplained_mask(m, ["rounds"])
    assert torch.equal(t, t0) and torch.equal(r, r0) and torch.equal(m, m0)  # inputs only read
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_valid_inputs_give_bit_identical_numbers_with_and_without_the_check(dtype, monkeypatch) -> None:
    t, r, m = _valid(3, dtype)
    r = r.masked_fill(
        torch.rand(B, T, generator=torch.Generator().manual_seed(4)) < 0.1, -math.inf
    )  # counted
    checked = _outputs(t, r, m)
    for module in (metrics, doctor, rounds, verify):
        monkeypatch.setattr(module, "check_log_probs", lambda *a, **k: None)
    monkeypatch.setattr(rounds, "check_mask", lambda where, name, mask: mask)
    unchecked = _outputs(t, r, m)
    for key, got in checked.items():
        want = unchecked[key]
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want), key
        else:
            assert got == want, key  # dicts of floats, VerifyResult, (sig, lines): exact equality


def test_the_tolerance_is_in_one_place_and_lets_rounding_through() -> None:
    assert metrics.MAX_LOG_PROB is tensor_inputs.MAX_LOG_PROB == 1e-3
    t, r, m = _valid()
    tensor_inputs.check_log_probs("x", {"t": t.clamp(min=-1e-9) + 9e-4, "r": r}, "m", m)
    with pytest.raises(
        MetricsInputError, match=r"^x: t has values up to 0\.0011 on response tokens, all in \[0, 1\]"
    ):
        tensor_inputs.check_log_probs("x", {"t": t.clamp(min=-1e-9) + 1.1e-3, "r": r}, "m", m)


# --- the in-run callers: a refused input is logged, the step goes on ----------------------------------------


def test_openrlhf_step_metrics_warn_and_go_on(monkeypatch) -> None:
    from rlalign_verl.base import log
    from rlalign_verl.openrlhf.setup import add_step_metrics

    monkeypatch.setattr(log, "_warned", set())
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("rlalign_verl.openrlhf").addHandler(handler)
    try:
        t, r, m = _valid()
        assert add_step_metrics([_experience(t.exp(), r, m)], None) is None  # probabilities
        assert add_step_metrics([_experience(torch.randint(0, 9, t.shape), r, m)], None) is None  # token ids
    finally:
        logging.getLogger("rlalign_verl.openrlhf").removeHandler(handler)
    assert any(
        "mismatch metrics skipped (MetricsInputError: compute_mismatch_metrics: " in x for x in records
    )
    assert any("openrlhf experience 0: action_log_probs is a int64 tensor" in x for x in records)


def test_verl_doctor_step_and_verify_guard_warn_and_go_on(monkeypatch) -> None:
    from rlalign_verl.base import log
    from rlalign_verl.verl.doctor_step import doctor_step
    from rlalign_verl.verl.verify_run import guarded

    monkeypatch.setattr(log, "_warned", set())
    t, r, m = _valid()
    batch = SimpleNamespace(batch={"old_log_probs": t, "rollout_log_probs": r, "response_mask": m * 0.5},
                            non_tensor_batch={})  # fmt: skip
    assert doctor_step(Doctor(), batch, 1) == {}
    skipped: list[BaseException] = []
    run = SimpleNamespace(warn_skipped=skipped.append)
    assert guarded(run, lambda: compare(t.exp(), r, r, m)) == {}
    assert isinstance(skipped[0], MetricsInputError) and "probabilities" in str(skipped[0])
