"""End to end against the real vLLM CPU engine: tiny models served compiled and eager; HF's log-probs
of the sampled tokens, unaligned vs aligned with the matching CPU profile. The aligned gap must be
clearly smaller. The numbers are printed (run with ``-s``) and recorded in the README.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlalign_verl.align.patch import apply_alignment, remove_alignment

pytestmark = pytest.mark.engine

PROFILE_FOR_MODE = {"compiled": "vllm-cpu", "eager": "vllm-cpu-eager"}
ALL = ("rope", "swiglu", "rmsnorm")


def hf_logprobs(model, rollouts) -> list[torch.Tensor]:
    """fp32 log-probs HF assigns to each rollout's sampled response tokens (bf16 forward)."""
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
    out = []
    for i, r in enumerate(rollouts):
        start, n = len(r.prompt_ids), len(r.response_ids)
        targets = torch.tensor(r.response_ids)
        out.append(lp[i, start - 1 : start - 1 + n].gather(-1, targets[:, None])[:, 0])
    return out


def mean_abs_gap(ours: list[torch.Tensor], rollouts) -> float:
    diffs = torch.cat([o - torch.tensor(r.response_logprobs) for o, r in zip(ours, rollouts, strict=True)])
    return diffs.abs().mean().item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_aligned_gap_is_clearly_smaller(engine_rollouts, arch: str, mode: str) -> None:
    run = engine_rollouts(arch, mode)
    assert run.header.profile == PROFILE_FOR_MODE[mode], "the engine run says which profile it follows"
    model = AutoModelForCausalLM.from_pretrained(
        run.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    base = mean_abs_gap(hf_logprobs(model, run.rollouts), run.rollouts)
    gaps = {}
    for profile in ("vllm-cpu", "vllm-cpu-eager"):
        apply_alignment(model, regions=ALL, engine=profile)
        gaps[profile] = mean_abs_gap(hf_logprobs(model, run.rollouts), run.rollouts)
        remove_alignment(model)
    matching = gaps[PROFILE_FOR_MODE[mode]]
    print(
        f"\n{arch}/{mode}: mean|dlogp| unaligned {base:.5f}  "
        + "  ".join(f"{k} {v:.5f}" for k, v in gaps.items())
    )
    assert matching < 0.9 * base, (base, gaps)
    # the matching profile beats the other execution path's profile
    other = gaps[PROFILE_FOR_MODE["eager" if mode == "compiled" else "compiled"]]
    assert matching <= other, gaps
