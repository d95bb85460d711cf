"""One rule for how much a bootstrap over sequences may decide (rlalign_verl.measure.intervals): below MIN_UNITS
sequences there is no interval and no verdict, and n_boot must carry the interval's level."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure import doctor, verify
from rlalign_verl.measure.doctor import Doctor, findings, signatures
from rlalign_verl.measure.intervals import MIN_UNITS, min_draws, percentile_interval, ratio_interval
from rlalign_verl.measure.verify import DECISION_LEVEL, VerifyFailedError, compare
from rlalign_verl.measure.verify_policy import Verifier, act_on, within_noise_line
from rlalign_verl.request.spec import AlignmentSpec

P = doctor.PREFIX
STOP = AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm", "verify": {"on_worse": "stop"}})


def _worse(seqs: int, tokens: int = 24, seed: int = 3):
    """Two passes where the aligned one is ~3x farther from the rollout on every sequence (clearly worse)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -(0.1 + 3 * torch.rand(seqs, tokens, generator=g, dtype=torch.float64))
    noise = torch.randn(seqs, tokens, generator=g, dtype=torch.float64).abs() * 0.05
    return (rollout - 3 * noise), (rollout - noise), rollout, torch.ones(seqs, tokens)


def test_the_reported_one_sequence_case_is_not_a_verdict_and_cannot_stop_a_run() -> None:
    r = -torch.rand(1, 8, generator=torch.Generator().manual_seed(0)) * 3
    u, a = r.clone(), r.clone()
    u[0, 0] += 0.01
    a[0, 1] += 0.0101
    res = compare(a, u, r, torch.ones(1, 8))
    assert res.verdict == 0 and res.gain < 1.0  # the point estimate still says "slightly worse"
    assert res.gain_ci is None and res.paired_diff_ci is None and res.decision_ci is None
    line = res.line(1, "vllm")
    assert "within noise" in line and "WORSE" not in line and f">= {MIN_UNITS}" in line
    assert not any(k.endswith(("_lo", "_hi")) for k in res.metrics())
    assert (
        res.metrics()["mismatch/verify/verdict"] == 0.0 and res.metrics()["mismatch/verify/num_seqs"] == 1.0
    )
    assert act_on(res, first=True, spec=STOP, fingerprint="vllm") is None  # on_worse=stop does not stop
    # even a result marked worse by hand stops nothing without an interval to back it
    assert act_on(dataclasses.replace(res, verdict=-1), first=True, spec=STOP, fingerprint="vllm") is None
    assert "too few" in within_noise_line(res)


def test_a_clearly_worse_profile_needs_min_units_sequences_to_be_worse() -> None:
    below = compare(*_worse(MIN_UNITS - 1))
    at = compare(*_worse(MIN_UNITS))
    assert below.gain < 0.5 and at.gain < 0.5  # both samples show the same large effect
    assert below.verdict == 0 and below.gain_ci is None
    assert at.verdict == -1 and at.gain_ci is not None and at.gain_ci[1] < 1.0
    with pytest.raises(VerifyFailedError):
        act_on(at, first=True, spec=STOP, fingerprint="vllm")


def test_sequences_without_a_valid_token_do_not_count() -> None:
    a, u, r, m = _worse(MIN_UNITS)
    m[0] = 0  # one sequence fully masked: 7 sequences left
    res = compare(a, u, r, m)
    assert res.num_seqs == MIN_UNITS - 1 and res.verdict == 0


def test_a_verifier_logs_too_few_sequences_as_within_noise(caplog) -> None:
    from rlalign_verl.catalog.fingerprint import EngineFingerprint
    from rlalign_verl.measure.verify_policy import schedule

    fp = EngineFingerprint("vllm", None, "cpu", "unknown")
    run = Verifier(STOP, "vllm", fp, schedule(STOP, False))
    with caplog.at_level("INFO", logger="rlalign_verl"):
        out = run.record(1, compare(*_worse(2)), {})
    assert out["mismatch/verify/verdict"] == 0.0 and "mismatch/verify/gain_lo" not in out
    assert any("too few to separate" in r.getMessage() for r in caplog.records)


def test_an_undecided_first_check_leaves_the_first_verdict_to_the_next_one(caplog) -> None:
    """Step 1 with too few sequences decides nothing: on_worse=stop (the first check's policy) still applies at the
    first check that has an interval, and the within-noise explanation is said again there."""
    from rlalign_verl.catalog.fingerprint import EngineFingerprint
    from rlalign_verl.measure.verify_policy import schedule

    fp = EngineFingerprint("vllm", None, "cpu", "unknown")
    run = Verifier(STOP, "vllm", fp, schedule(STOP, False))
    with caplog.at_level("INFO", logger="rlalign_verl"):
        run.record(1, compare(*_worse(2)), {})
        assert not run.first_done
        with pytest.raises(VerifyFailedError):
            run.record(11, compare(*_worse(MIN_UNITS)), {})
    assert run.first_done


def test_one_rule_for_units_and_draws_across_verify_and_doctor() -> None:
    assert doctor.MIN_SEQS == MIN_UNITS == 8
    assert min_draws(doctor.LEVEL) == 100  # the doctor's floor: 2.5 draws beyond each end of a 95% interval
    assert min_draws(DECISION_LEVEL) == verify.N_BOOT == 5000  # verify's default can carry its 99.9% verdict
    assert doctor.N_BOOT >= min_draws(doctor.LEVEL)


@pytest.mark.parametrize("n_boot", [0, -1, 1, 4999, 1.5, True, "5000", None])
def test_compare_refuses_an_n_boot_that_cannot_carry_the_decision_interval(n_boot) -> None:
    a, u, r, m = _worse(MIN_UNITS)
    with pytest.raises(MetricsInputError, match=r"^verify\.compare: n_boot=.*give an int >= 5000") as err:
        compare(a, u, r, m, n_boot=n_boot)
    assert "\n" not in str(err.value)


def test_signatures_carry_a_bias_interval_only_from_min_units_sequences() -> None:
    g = torch.Generator().manual_seed(1)
    rollout = -(0.1 + 3 * torch.rand(MIN_UNITS, 40, generator=g, dtype=torch.float64))
    train = rollout - 0.2  # a one-sided offset on every token: a bias finding when the sample can carry it
    one = signatures(train[:1], rollout[:1], torch.ones(1, 40))
    below = signatures(train[:-1], rollout[:-1], torch.ones(MIN_UNITS - 1, 40))
    at = signatures(train, rollout, torch.ones(MIN_UNITS, 40))
    for sig in (one, below):
        assert (
            sig[P + "bias"] == pytest.approx(-0.2) and P + "bias_lo" not in sig and P + "bias_hi" not in sig
        )
        assert findings(sig) == []
    assert at[P + "bias_lo"] <= at[P + "bias"] <= at[P + "bias_hi"] < 0
    assert [cause for cause, _ in findings(at)] == ["bias"]
    # the same rule in the per-step doctor
    assert Doctor().step(1, train[:-1], rollout[:-1], torch.ones(MIN_UNITS - 1, 40))[1] == []
    assert "systematic bias" in Doctor().step(1, train, rollout, torch.ones(MIN_UNITS, 40))[1][0]


def test_the_interval_helpers_refuse_too_few_draws_and_bad_levels() -> None:
    with pytest.raises(MetricsInputError, match="too few for a 95% interval; draw at least 100"):
        percentile_interval(torch.arange(99.0))
    assert percentile_interval(torch.arange(100.0)) == pytest.approx((2.475, 96.525))
    for level in (0.0, 1.0, 1.5, "0.95", True):
        with pytest.raises(MetricsInputError, match="level="):
            percentile_interval(torch.arange(5000.0), level=level)
    with pytest.raises(MetricsInputError, match="3 sums but 2 counts"):
        ratio_interval(torch.ones(3), torch.ones(2), seed=0, n_boot=100)
