"""Multi-turn on the real engine: two assistant rounds of vLLM CPU rollouts, scored by the HF trainer.

Each engine rollout (32 sampled tokens) becomes a two-round conversation: round 1 is its first 10 tokens, the
next 4 are the environment's turn (response_mask 0: tokens the model did not generate as this round), round 2
the rest. The engine sampled round 2 in exactly that history, so a token-in-token-out pipeline (verl's agent
loop) hands the trainer the engine's context and the gap is rounding's. A pipeline that keeps the conversation
as text renders the environment's turn again (here: its text plus a newline, as a chat template may add) or
encodes every turn again: the trainer then scores round 2 in a history the engine never saw, or scores other
ids. The doctor must name those, and nothing in the token-in batch. The session's engine run is reused.
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.measure.doctor import Doctor
from rlalign_verl.tools.diagnose.pipeline import load_hf

pytestmark = pytest.mark.engine

FIRST, ENV = 10, 4


def _conversations(er, render: str) -> dict[str, torch.Tensor]:
    """The verl-layout batch (left-padded prompts, right-padded responses) of every rollout as two rounds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(er.model_dir)

    def again(ids: list[int], suffix: str = "") -> list[int]:  # the text pipeline: decode, then encode
        return tok(tok.decode(ids) + suffix, add_special_tokens=False)["input_ids"]

    hf, rows = load_hf(er.model_dir), []
    for r in er.rollouts:
        ids, lp = r.response_ids, r.response_logprobs
        assert len(ids) >= FIRST + ENV + 8, "the session's rollouts are 32 tokens (ignore_eos)"
        turns = [ids[:FIRST], ids[FIRST : FIRST + ENV], ids[FIRST + ENV :]]
        if render == "env":  # the environment's turn rendered again from its text
            turns[1] = again(turns[1], "\n")
        elif render == "all":
            turns = [again(t) for t in turns]
        one, env, two = turns
        # the engine's log-probs and ids of each round, laid out where the pipeline puts that round
        sampled = [(ids[:FIRST], lp[:FIRST], len(one)), (ids[FIRST + ENV :], lp[FIRST + ENV :], len(two))]
        fit = [(i + [-1] * n)[:n] + [-1] * (len(env) if k == 0 else 0) for k, (i, _, n) in enumerate(sampled)]
        fit_lp = [
            (v + [0.0] * n)[:n] + [0.0] * (len(env) if k == 0 else 0) for k, (_, v, n) in enumerate(sampled)
        ]
        response = one + env + two
        full = torch.tensor(r.prompt_ids + response)
        with torch.no_grad():  # the trainer: bf16 HF model, fp32 log-softmax of the logits
            logp = hf(full[None]).logits[0].float().log_softmax(-1)
        n = len(r.prompt_ids)
        rows.append({
            "prompt": r.prompt_ids, "response": response,
            "train": logp[n - 1 : -1].gather(-1, full[n:, None])[:, 0].tolist(),
            "rollout": sum(fit_lp, []), "rollout_ids": sum(fit, []),
            "mask": [1] * len(one) + [0] * len(env) + [1] * len(two),
        })  # fmt: skip
    p, t = max(len(x["prompt"]) for x in rows), max(len(x["response"]) for x in rows)

    def right(key, fill, dtype):
        return torch.tensor([x[key] + [fill] * (t - len(x[key])) for x in rows], dtype=dtype)

    prompts = torch.tensor([[0] * (p - len(x["prompt"])) + x["prompt"] for x in rows])
    responses = right("response", 0, torch.long)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "response_mask": right("mask", 0, torch.long),
        "old_log_probs": right("train", 0.0, torch.float32),
        "rollout_log_probs": right("rollout", 0.0, torch.float32),
        "rollout_ids": right("rollout_ids", -1, torch.long),
    }


def _step(batch: dict[str, torch.Tensor], **ids) -> tuple[dict[str, float], list[str]]:
    args = [batch[k] for k in ("old_log_probs", "rollout_log_probs", "response_mask")]
    return Doctor({"multi_turn": True}).step(1, *args, **ids)


def test_token_in_multi_turn_names_nothing_and_logs_each_round(engine_rollouts):
    batch = _conversations(engine_rollouts("qwen2", "compiled"), "token_in")
    sig, lines = _step(batch, trainer_ids=batch["responses"], rollout_ids=batch["rollout_ids"])
    assert lines == [] and sig["mismatch/doctor/findings"] == 0.0, lines
    assert sig["mismatch/rounds/per_seq_mean"] == 2.0 and sig["mismatch/doctor/token_id_mismatch"] == 0.0
    for k in (1, 2):  # rounding's gap in both rounds: never a nat, never zero (the trainer is not aligned)
        assert sig[f"mismatch/round_{k}/share_above_1"] == 0.0
        assert 0.0 < sig[f"mismatch/round_{k}/logp_abs_diff_mean"] < 0.2
    assert sig["mismatch/round_1/num_tokens"] == FIRST * len(batch["responses"])


def test_a_re_rendered_turn_is_named_through_verls_step(engine_rollouts):
    verl = pytest.importorskip("verl")
    from rlalign_verl.verl.doctor_step import doctor_step

    batch = _conversations(engine_rollouts("qwen2", "compiled"), "env")
    rollout_ids = batch.pop("rollout_ids")
    assert batch["responses"].ne(torch.where(rollout_ids < 0, batch["responses"], rollout_ids)).sum() == 0
    doctor = Doctor({"multi_turn": True})
    sig = doctor_step(doctor, verl.DataProto.from_dict(batch), 1)
    assert sig["mismatch/round_1/share_above_1"] < 0.01 < 0.05 < sig["mismatch/round_2/share_above_1"]
    assert sig["mismatch/doctor/token_id_mismatch"] == 0.0  # the ids are the engine's; the history is not
    assert sig["mismatch/doctor/findings"] == 1.0
    assert doctor.said == {"rounds": 1}


def test_re_encoded_turns_are_named_by_the_token_identity_check(engine_rollouts):
    batch = _conversations(engine_rollouts("qwen2", "compiled"), "all")
    sig, lines = _step(batch, trainer_ids=batch["responses"], rollout_ids=batch["rollout_ids"])
    assert sig["mismatch/doctor/token_id_mismatch"] > 0.1, (
        "the tiny tokenizer re-encodes sampled text differently"
    )
    assert any("other token ids than the rollout sampled" in line for line in lines), lines
    assert not any("systematic bias" in line or "heavy tails" in line for line in lines), lines
