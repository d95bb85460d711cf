"""The mismatch doctor on mechanistic data: each cause produced for real (sampling with top-p and processed
log-probs, a temperature on one side, a shifted token, a fixed seed per group, a failed weight sync) next to
pure bf16 rounding (the same logits through two op orders), which must name nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure import doctor
from rlalign_verl.measure.doctor import Doctor, GapTrend, diagnose_signature, findings, signatures

B, T, D, V, GROUP = 64, 48, 64, 256, 4
P = doctor.PREFIX


class TinyHead:
    """A final RMSNorm + LM head over random hidden states; 30% of positions nearly deterministic."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        g = self.gen
        self.h = torch.randn(B, T, D, generator=g) * torch.empty(B, T, 1).uniform_(0.5, 3.0, generator=g)
        self.w = 1 + 0.1 * torch.randn(D, generator=g)
        self.W = torch.randn(D, V, generator=g) / D**0.5
        flat = torch.empty(B, T, 1).uniform_(1.0, 5.0, generator=g)
        self.sharp = torch.where(torch.rand(B, T, 1, generator=g) < 0.3, torch.full_like(flat, 12.0), flat)

    def trainer_logits(self, W: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm in fp32, then the bf16 matmul (a training stack's order)."""
        x = self.h * torch.rsqrt(self.h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return (x.bfloat16() @ (self.W if W is None else W).bfloat16()).double() * self.sharp

    def rollout_logits(self, W: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm in bf16 arithmetic, then the bf16 matmul (an engine's order)."""
        hb = self.h.bfloat16()
        x = hb * torch.rsqrt(hb.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w.bfloat16()
        return (x @ (self.W if W is None else W).bfloat16()).double() * self.sharp

    def sample(self, logp: torch.Tensor, *, per_group: bool = False) -> torch.Tensor:
        """Token ids ``[B, T]`` drawn from ``exp(logp)``; ``per_group``: one draw copied to the whole group."""
        probs = logp.exp().reshape(-1, V).float()
        tok = torch.multinomial(probs, 1, generator=self.gen).view(B, T)
        return tok[::GROUP].repeat_interleave(GROUP, 0) if per_group else tok


def pick(logp: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, tok[..., None])[..., 0]


def top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's top-p set: the most probable tokens whose cumulative mass first reaches ``top_p``."""
    probs, idx = logits.softmax(-1).sort(-1, descending=True)
    keep_sorted = (probs.cumsum(-1) - probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)


MASK = torch.ones(B, T)
UID = [f"prompt-{i // GROUP}" for i in range(B)]


def causes(sig: dict[str, float], context: dict | None = None) -> list[str]:
    return [cause for cause, _ in findings(sig, context)]


def rounding_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head = TinyHead(seed)
    roll = head.rollout_logits().log_softmax(-1)
    tok = head.sample(roll)
    return pick(head.trainer_logits().log_softmax(-1), tok), pick(roll, tok), tok


@pytest.mark.parametrize("seed", range(5))
def test_pure_rounding_names_nothing(seed):
    train, rollout, tok = rounding_case(seed)
    sig = signatures(train, rollout, MASK, uid=UID, responses=tok, seed=seed)
    assert sig[P + "abs_mean"] > 1e-3  # the two op orders really differ
    assert sig[P + "bias_share"] < 0.2 and 0.4 < sig[P + "pos_share"] < 0.6
    assert abs(sig[P + "corr_logprob"]) < 0.1 and sig[P + "share_above_1"] == 0
    assert sig[P + "dup_rate"] == 0
    assert diagnose_signature(sig, context={"top_p": 1.0, "top_k": -1, "temperature": 1.0}) == []
    # the same data with a small one-sided offset on the rollout side is named: this test can fail
    shifted = signatures(train, rollout - 0.05, MASK, seed=seed)
    assert causes(shifted) == ["bias"]


@pytest.mark.parametrize("top_p", [0.8, 0.95])
def test_top_p_with_processed_logprobs_is_named(top_p):
    head = TinyHead(1)
    logits = head.rollout_logits()
    keep = top_p_keep(logits, top_p)
    processed = logits.masked_fill(~keep, -math.inf).log_softmax(-1)  # vLLM processed_logprobs
    tok = head.sample(processed)
    train = pick(head.trainer_logits().log_softmax(-1), tok)  # verl's trainer: no filter
    rollout = pick(processed, tok)
    sig = signatures(train, rollout, MASK)
    kept_mass = (logits.softmax(-1) * keep).sum(-1).log().mean()
    assert sig[P + "bias"] == pytest.approx(float(kept_mass), abs=0.01)  # Δ = log(kept mass)
    assert sig[P + "bias_hi"] < 0 and sig[P + "bias_share"] > 0.9
    context = {"top_p": top_p, "top_k": -1, "temperature": 1.0}
    [(cause, line)] = findings(sig, context)
    assert cause == "bias"
    assert f"top_p={top_p:g} in this run" in line and "processed log-probs" in line and "not rounding" in line
    [bare] = diagnose_signature(sig)  # without the run's settings: the candidates, named
    assert "top_p/top_k/min_p" in bare


def test_top_k_with_processed_logprobs_is_named():
    head = TinyHead(2)
    logits = head.rollout_logits()
    kth = logits.topk(20, -1).values[..., -1:]
    processed = logits.masked_fill(logits < kth, -math.inf).log_softmax(-1)
    tok = head.sample(processed)
    sig = signatures(pick(head.trainer_logits().log_softmax(-1), tok), pick(processed, tok), MASK)
    [(cause, line)] = findings(sig, {"top_p": 1.0, "top_k": 20})
    assert cause == "bias" and "top_k=20 in this run" in line


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_on_one_side_is_named(temperature):
    head = TinyHead(3)
    # vLLM processed log-probs at T, a trainer that does not divide by T
    processed = (head.rollout_logits() / temperature).log_softmax(-1)
    tok = head.sample(processed)
    sig = signatures(pick(head.trainer_logits().log_softmax(-1), tok), pick(processed, tok), MASK)
    [(cause, line)] = findings(sig, {"temperature": temperature})
    assert cause == "temperature" and f"temperature={temperature:g} in this run" in line
    sharper = "rollout's" if temperature < 1 else "trainer's"
    assert f"the {sharper} side has the sharper distribution" in line
    # verl's trainer divides by T while vLLM reports raw log-probs: the other side is the sharper one
    raw = head.rollout_logits().log_softmax(-1)
    tok = head.sample((head.rollout_logits() / temperature).log_softmax(-1))
    sig = signatures(pick((head.trainer_logits() / temperature).log_softmax(-1), tok), pick(raw, tok), MASK)
    [(cause, line)] = findings(sig, {"temperature": temperature})
    other = "trainer's" if temperature < 1 else "rollout's"
    assert cause == "temperature" and f"the {other} side has the sharper distribution" in line


def test_one_token_shift_names_heavy_tails():
    train, rollout, _ = rounding_case(4)
    shifted = torch.cat([rollout[:, 1:], rollout[:, -1:]], 1)  # the rollout's log-prob of the next token
    mask = MASK.clone()
    mask[:, -1] = 0
    sig = signatures(train, shifted, mask)
    assert sig[P + "share_above_1"] > 0.2 and abs(sig[P + "corr_logprob"]) < 0.1  # tails, no sharper side
    [(cause, line)] = findings(sig, {"multi_turn": True})
    assert cause == "tails" and "one-token shift" in line and "multi-turn is on" in line
    assert causes(signatures(train, rollout, mask)) == []


def test_duplicate_groups_are_named():
    head = TinyHead(5)
    roll = head.rollout_logits().log_softmax(-1)
    tok = head.sample(roll, per_group=True)  # one seed per prompt: every sample of a group is the same
    sig = signatures(
        pick(head.trainer_logits().log_softmax(-1), tok), pick(roll, tok), MASK, uid=UID, responses=tok
    )
    assert sig[P + "dup_rate"] == 1.0 and sig[P + "dup_groups"] == 1.0
    [(cause, line)] = findings(sig)
    assert cause == "duplicates" and "zero GRPO advantage" in line
    # identical rows in different groups are not duplicates; padding after the mask does not count
    tok2 = torch.arange(B * T).view(B, T) % V
    tok2[4] = tok2[3]  # rows 3 and 4 sit in different groups
    tok2[5, :-3] = tok2[4, :-3]
    mask = MASK.clone()
    mask[5, -3:] = 0
    mask[4, -3:] = 0
    uid = np.array(UID, dtype=object)
    dup = signatures(pick(roll, tok2), pick(roll, tok2), mask, uid=uid, responses=tok2)
    assert dup[P + "dup_rate"] == pytest.approx(2 / B)  # rows 4, 5 (same group, equal on their mask); not 3
    assert dup[P + "dup_groups"] == 0.0


def test_failed_weight_sync_shows_as_growing_gap():
    head = TinyHead(6)
    drift = torch.randn(D, V, generator=head.gen) / D**0.5
    stale, synced, lines = Doctor(), Doctor(), []
    roll = head.rollout_logits().log_softmax(-1)
    for step in range(1, 11):
        weights = head.W + 0.005 * step * drift  # the trainer learns
        train = head.trainer_logits(weights).log_softmax(-1)
        tok = head.sample(roll)  # the rollout never receives the new weights
        sig, said = stale.step(step, pick(train, tok), pick(roll, tok), MASK)
        lines += said
        fresh = head.rollout_logits(weights).log_softmax(-1)
        tok = head.sample(fresh)  # a rollout that is synced every step: rounding only
        calm, calm_said = synced.step(step, pick(train, tok), pick(fresh, tok), MASK)
        assert calm_said == []
    assert sig[P + "gap_growth_lo"] > 0 and sig[P + "gap_growth_rel"] > 0.5
    assert any("the gap grows" in line for line in lines)
    assert calm[P + "gap_growth_rel"] < 0.5


def test_values_by_hand_and_chunking(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    rollout = -torch.rand(16, 10, generator=gen, dtype=torch.float64) * 3
    train = rollout + 0.3 * torch.randn(16, 10, generator=gen, dtype=torch.float64)
    train = train.clamp(max=0)
    mask = (torch.rand(16, 10, generator=gen) > 0.2).float()
    mask[3] = 0
    sig = signatures(train, rollout, mask)
    v = mask.bool().numpy()
    d, r = (train - rollout).numpy()[v], rollout.numpy()[v]
    mid = (train + rollout).numpy()[v] / 2
    assert sig[P + "num_tokens"] == v.sum() and sig[P + "num_seqs"] == 15
    assert sig[P + "bias"] == pytest.approx(d.mean()) and sig[P + "abs_mean"] == pytest.approx(
        np.abs(d).mean()
    )
    assert sig[P + "share_above_0p1"] == pytest.approx((np.abs(d) > 0.1).mean())
    assert sig[P + "pos_share"] == pytest.approx((d > 0).sum() / (d != 0).sum())
    assert sig[P + "corr_prob"] == pytest.approx(np.corrcoef(d, np.exp(r))[0, 1])
    assert sig[P + "corr_logprob"] == pytest.approx(np.corrcoef(d, mid)[0, 1])
    assert sig[P + "abs_corr_prob"] == pytest.approx(np.corrcoef(np.abs(d), np.exp(r))[0, 1])
    assert sig[P + "bias_lo"] < sig[P + "bias"] < sig[P + "bias_hi"]
    monkeypatch.setattr(doctor, "CHUNK_ELEMENTS", 7)  # one row per chunk: the same numbers
    chunked = signatures(train, rollout, mask)
    assert chunked.keys() == sig.keys()
    assert all(chunked[k] == pytest.approx(sig[k], rel=1e-12, abs=1e-15) for k in sig)


def test_nonfinite_and_empty_inputs_give_counts_only():
    train = torch.full((2, 3), -1.0)
    rollout = torch.tensor([[-1.0, float("nan"), -2.0], [-1.0, -1.0, -math.inf]])
    sig = signatures(train, rollout, torch.tensor([[1, 1, 0], [0, 0, 1]]))
    assert sig[P + "num_tokens"] == 1 and sig[P + "nonfinite_tokens"] == 2
    empty = signatures(train, rollout, torch.zeros(2, 3))
    assert empty == {P + "num_tokens": 0.0, P + "num_seqs": 0.0, P + "nonfinite_tokens": 0.0}
    assert signatures(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5))[P + "num_tokens"] == 0
    assert diagnose_signature(empty) == []


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), {}, "one [batch, response_len] shape"),
        (([[0.0]], torch.zeros(1, 1), torch.ones(1, 1)), {}, "old_log_probs is a list"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 0.5)), {}, "other than 0 and 1"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)), {}, "floating point"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)), {"uid": ["a", "b"]}, "together"),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)),
            {"uid": ["a"], "responses": torch.zeros(2, 3, dtype=torch.long)},
            "one group id per sequence",
        ),  # fmt: skip
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)),
            {"uid": ["a", "b"], "responses": torch.zeros(2, 3)},
            "token ids",
        ),  # fmt: skip
        ((torch.full((2, 3), 0.5), torch.zeros(2, 3), torch.ones(2, 3)), {}, "probabilities, not log-probs"),
        ((torch.full((2, 3), 3.0), torch.zeros(2, 3), torch.ones(2, 3)), {}, "pass log-probs, not logits"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)), {"n_boot": 10}, "n_boot=10"),
    ],
)
def test_bad_inputs_fail_in_one_line(args, kwargs, needle):
    with pytest.raises(MetricsInputError) as err:
        signatures(*args, **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_gap_trend_slope_and_interval():
    trend = GapTrend(window=10, min_points=5)
    assert [trend.update(s, 0.01 + 0.002 * s) for s in range(4)] == [{}] * 4
    out = trend.update(4, 0.018)
    assert out[P + "gap_growth"] == pytest.approx(0.002) and out[P + "gap_growth_lo"] == pytest.approx(0.002)
    assert out[P + "gap_growth_rel"] == pytest.approx(0.002 * 4 / 0.014)
    noise = np.random.default_rng(0).normal(0.02, 0.001, 40)
    flat = GapTrend()
    for step, gap in enumerate(noise):
        out = flat.update(step, float(gap))
    assert out[P + "gap_growth_lo"] < 0 < out[P + "gap_growth_hi"] and len(flat.points) == 20
    flat.update(39, 5.0)  # a repeated step replaces its value
    assert flat.points[-1] == (39.0, 5.0) and len(flat.points) == 20
    assert flat.update(3, 0.02) == {} and flat.points == [(3.0, 0.02)]  # a resumed run starts afresh
    with pytest.raises(ValueError):
        GapTrend(window=4, min_points=5)


def test_doctor_repeats_a_cause_only_every_n_steps():
    train, rollout, _ = rounding_case(0)
    doc = Doctor({"top_p": 0.8}, repeat_every=3)
    said = [doc.step(step, train - 0.1, rollout, MASK)[1] for step in range(7)]
    assert [len(s) for s in said] == [1, 0, 0, 1, 0, 0, 1]
    assert said[0][0].startswith("step 0: systematic bias") and "top_p=0.8 in this run" in said[0][0]
    sig, _ = doc.step(7, train, rollout, MASK)
    assert sig[P + "findings"] == 0.0


def test_the_docs_name_every_key():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reading-a-mismatch.md").read_text()
    train, rollout, tok = rounding_case(0)
    doc_steps = Doctor()
    for step in range(6):
        sig, _ = doc_steps.step(step, train, rollout, MASK, uid=UID, responses=tok)
    names = {k.removeprefix(P) for k in sig}
    assert len(names) == 22  # 3 counts, 12 statistics, 2 duplicate rates, 4 growth keys, findings
    missing = [n for n in names if f"`{n}`" not in doc and f"`{n.rsplit('_', 1)[0]}`, `_" not in doc]
    assert missing == []
