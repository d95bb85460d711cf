"""Every public function of rlalign_verl.measure refuses a bad scalar argument (seed, count, window, switch,
prefix, settings mapping) with one typed line that names the argument and the fix, at the call that takes it."""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure.doctor import Doctor, GapTrend, diagnose_signature, findings, signatures
from rlalign_verl.measure.intervals import resampled_sums
from rlalign_verl.measure.metrics import compute_mismatch_metrics, sorted_quantiles
from rlalign_verl.measure.turns import round_findings, round_index, round_metrics, unexplained_mask
from rlalign_verl.measure.verify import compare, ladder_metrics
from rlalign_verl.measure.verify_policy import act_on, schedule
from rlalign_verl.request.spec import AlignmentSpec

LP = -torch.rand(8, 6, generator=torch.Generator().manual_seed(0)) * 3
ONES = torch.ones(8, 6)
SPEC = AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm"})

CASES = {
    "compare seed str": (lambda: compare(LP, LP, LP, ONES, seed="x"), "verify.compare: seed='x'"),
    "compare seed None": (lambda: compare(LP, LP, LP, ONES, seed=None), "verify.compare: seed=None"),
    "compare seed float": (lambda: compare(LP, LP, LP, ONES, seed=1.5), "verify.compare: seed=1.5"),
    "compare seed bool": (lambda: compare(LP, LP, LP, ONES, seed=True), "verify.compare: seed=True"),
    "compare seed too big": (lambda: compare(LP, LP, LP, ONES, seed=2**64), "seed's range"),
    "signatures seed": (lambda: signatures(LP, LP, ONES, seed="x"), "doctor.signatures: seed='x'"),
    "signatures prefix": (lambda: signatures(LP, LP, ONES, prefix=None), "doctor.signatures: prefix=None"),
    "resampled_sums seed": (lambda: resampled_sums(torch.ones(2, 3), seed=None, n_boot=10), "seed=None"),
    "resampled_sums n_boot": (lambda: resampled_sums(torch.ones(2, 3), seed=0, n_boot=0), "n_boot=0"),
    "resampled_sums no unit": (lambda: resampled_sums(torch.ones(2, 0), seed=0, n_boot=10), "U >= 1 units"),
    "Doctor window": (lambda: Doctor(window=4), "Doctor: window=4 is below 5"),
    "Doctor window float": (lambda: Doctor(window=20.0), "Doctor: window=20.0 is a float"),
    "Doctor context str": (lambda: Doctor(context="top_p=0.8"), "Doctor: context is a str"),
    "Doctor context top_p str": (lambda: Doctor({"top_p": "0.8"}), "Doctor: context['top_p']='0.8' is a str"),
    "Doctor context top_p range": (lambda: Doctor({"top_p": 1.5}), "context['top_p']=1.5 is out of range"),
    "Doctor context top_k": (lambda: Doctor({"top_k": 2.5}), "context['top_k']=2.5 is not a whole number"),
    "Doctor context temperature": (lambda: Doctor({"temperature": "0.7"}), "context['temperature']='0.7'"),
    "Doctor multi_turn": (lambda: Doctor({"multi_turn": "false"}), "context['multi_turn']='false' is a str"),
    "Doctor repeat_every str": (lambda: Doctor(repeat_every="5"), "Doctor: repeat_every='5' is a str"),
    "Doctor repeat_every None": (lambda: Doctor(repeat_every=None), "Doctor: repeat_every=None"),
    "Doctor repeat_every 0": (lambda: Doctor(repeat_every=0), "Doctor: repeat_every=0 is below 1"),
    "findings top_p str": (lambda: findings({}, {"top_p": "0.8"}), "doctor.findings: context['top_p']='0.8'"),
    "findings sig list": (lambda: findings([1, 2]), "doctor.findings: sig is a list"),
    "findings sig value": (lambda: findings({"num_tokens": "500"}), "sig['num_tokens']='500' is a str"),
    "diagnose_signature list": (
        lambda: diagnose_signature([1, 2]),
        "doctor.diagnose_signature: sig is a list",
    ),
    "diagnose_signature context": (
        lambda: diagnose_signature({}, context=[("top_p", 0.8)]),
        "context is a list",
    ),
    "GapTrend window": (lambda: GapTrend(window=4), "GapTrend: window=4 is below min_points=5"),
    "GapTrend min_points": (lambda: GapTrend(min_points=2), "GapTrend: min_points=2 is below 3"),
    "GapTrend prefix": (lambda: GapTrend(prefix=None), "GapTrend: prefix=None"),
    "GapTrend.update step": (lambda: GapTrend().update("3", 0.1), "GapTrend.update: step='3'"),
    "GapTrend.update gap": (lambda: GapTrend().update(3, "0.1"), "GapTrend.update: abs_mean='0.1'"),
    "round_index 0": (lambda: round_index(ONES, max_rounds=0), "rounds.round_index: max_rounds=0 is below 2"),
    "round_index -1": (
        lambda: round_index(ONES, max_rounds=-1),
        "rounds.round_index: max_rounds=-1 is below 2",
    ),
    "round_index 1.5": (lambda: round_index(ONES, max_rounds=1.5), "max_rounds=1.5 is a float"),
    "round_metrics 1": (
        lambda: round_metrics(LP, LP, ONES, max_rounds=1),
        "round_metrics: max_rounds=1 is below 2",
    ),
    "round_metrics prefix": (lambda: round_metrics(LP, LP, ONES, prefix=None), "round_metrics: prefix=None"),
    "round_metrics inputs_checked": (
        lambda: round_metrics(LP, LP, ONES, inputs_checked="yes"),
        "inputs_checked='yes'",
    ),
    "round_findings list": (lambda: round_findings([1]), "rounds.round_findings: metrics is a list"),
    "round_findings value": (
        lambda: round_findings({"mismatch/doctor/token_id_mismatch": "0.1"}),
        "is a str",
    ),
    "round_findings prefix": (lambda: round_findings({}, prefix=None), "round_findings: prefix=None"),
    "unexplained_mask str": (lambda: unexplained_mask(ONES, "rounds"), "unexplained_mask: causes is a str"),
    "unexplained_mask unknown": (lambda: unexplained_mask(ONES, ["bias"]), "unknown cause(s) ['bias']"),
    "unexplained_mask one id": (lambda: unexplained_mask(ONES, ["token_ids"], ONES.long()), "together"),
    "metrics prefix None": (
        lambda: compute_mismatch_metrics(LP, LP, ONES, prefix=None),
        "prefix=None is a NoneType",
    ),
    "metrics quantiles str": (
        lambda: compute_mismatch_metrics(LP, LP, ONES, quantiles="false"),
        "quantiles='false'",
    ),
    "metrics quantiles int": (
        lambda: compute_mismatch_metrics(LP, LP, ONES, quantiles=0),
        "quantiles=0 is an int",
    ),
    "sorted_quantiles q": (
        lambda: sorted_quantiles(torch.ones(3), (1.5,)),
        "quantile 1.5 is not a number in [0, 1]",
    ),
    "sorted_quantiles values": (
        lambda: sorted_quantiles([1.0], (0.5,)),
        "values must be a non-empty 1-D tensor",
    ),
    "ladder_metrics rung": (lambda: ladder_metrics({1: LP}, LP, ONES), "verify.ladder_metrics: a rung name"),
    "line profile": (lambda: compare(LP, LP, LP, ONES).line(1, None), "VerifyResult.line: profile=None"),
    "schedule bool": (lambda: schedule(SPEC, "false"), "schedule: unverified_engine='false' is a str"),
    "act_on first": (
        lambda: act_on(compare(LP, LP, LP, ONES), first="no", spec=SPEC, fingerprint="x"),
        "first='no'",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_argument_is_one_typed_line_naming_it(name) -> None:
    call, needle = CASES[name]
    with pytest.raises(MetricsInputError) as err:
        call()
    text = str(err.value)
    assert needle in text and "\n" not in text, text
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


def test_doctor_window_names_only_the_users_argument() -> None:
    with pytest.raises(MetricsInputError) as err:
        Doctor(window=4)
    assert "window=4" in str(err.value) and "min_points" not in str(err.value)


def test_valid_settings_still_pass_and_are_used() -> None:
    sig = {"num_tokens": 5000.0, "num_seqs": 64.0, "abs_mean": 0.2, "bias": -0.2, "bias_lo": -0.21,
           "bias_hi": -0.19, "bias_share": 1.0, "corr_logprob": 0.0, "share_above_1": 0.0}  # fmt: skip
    # numbers (numpy and 0-d tensors included) and None for a setting left at its default
    np = pytest.importorskip("numpy")
    for top_p in (0.8, np.float32(0.8), np.float64(0.8)):
        [line] = diagnose_signature(sig, context={"top_p": top_p, "top_k": -1.0, "temperature": None})
        assert "top_p=0.8 in this run" in line
    assert "multi-turn is on" not in " ".join(diagnose_signature(sig, context={"multi_turn": False}))
    assert diagnose_signature({**sig, "bias": torch.tensor(-0.2)}) == diagnose_signature(sig)
    # verl's own context (doctor_context) has text keys next to the numbers: they pass through
    Doctor({"rollout": "vllm", "top_p": 1.0, "top_k": -1.0, "temperature": 1.0, "logprobs_mode": "processed_logprobs",
            "multi_turn": False, "trainer_mode": "sync"})  # fmt: skip
    assert round_index(ONES, max_rounds=None).max() == 1 and round_index(ONES, max_rounds=2).max() == 1
    no_q = compute_mismatch_metrics(LP, LP - 0.1, ONES, quantiles=False, prefix="x/")
    assert "x/logp_abs_diff_p50" not in no_q and no_q["x/num_tokens"] == 48
    assert compare(LP, LP, LP, ONES, seed=np.int64(3)) == compare(LP, LP, LP, ONES, seed=3)
