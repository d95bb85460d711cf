"""The aligned MoE experts keep no copy of the expert weights for backward.

The fused expert kernels accumulate bf16 products in fp32; computing that as ``a.float() @ w.float().t()`` under
autograd kept an fp32 copy of every hit expert's weights (twice their bf16 size, per MoE layer, until backward:
~38 GB on a Qwen3-30B-A3B-sized model without checkpointing). Counted with ``saved_by_module``
(tests/support/saved_memory.py: distinct non-parameter storages saved for backward) on a tiny Qwen3-MoE whose
weights have both dimensions above the token count, so any saved storage with two such dimensions is a weight copy.
At rollout TP > 1 the experts of every rank are recomputed in backward (``tp._ExpertPartsFn``), emulated or the
engine's op: the ranks' activations (their H-wide ones tp times the unsplit experts') are not kept from forward to
backward; a rank's gate and up rows are two views of the parameter, not a concatenated copy.

Measured (T=64 below; MoE blocks' saved bytes, HF 0.42 MB): at TP 2, swiglu + moe + tp on vllm-cpu emulated 2.32 MB
(5.5x HF: a concatenated gate_up copy per layer and the ranks' activations) -> 1.33 MB with views -> 0.05 MB
recomputed; tp alone on vllm-cpu-eager 1.76 -> 0.06 MB; swiglu + moe + tp on vllm 1.76 -> 0.06 MB.

Measured (hidden 256, 8 experts, 2 layers, 256 tokens; MoE blocks' saved bytes): HF 2.12 MB; swiglu + moe on vllm
4.61 -> 2.38 MB, on vllm-cpu 11.16 -> 4.48 MB (its fp32 GEMM outputs feed the SwiGLU: activations).
"""

from __future__ import annotations

import pytest
import torch
from saved_memory import saved_by_module
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from rlalign_verl.align.patch import apply_alignment, remove_alignment

T = 64  # tokens: every activation has a dimension <= T, every weight both dimensions > T


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(
        hidden_size=192, intermediate_size=384, moe_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, vocab_size=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()


def _experts_saved(model: torch.nn.Module) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    by_module = saved_by_module(
        model, torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(0))
    )
    return [
        item
        for name, items in by_module.items()
        if name.endswith(".mlp") or ".mlp." in name
        for item in items
    ]


@pytest.mark.parametrize(
    "profile, regions, tp, options",
    [
        ("vllm", ("swiglu", "moe"), 1, {"unverified": ["moe"]}),
        ("sglang", ("swiglu", "moe"), 1, {"unverified": ["moe"]}),
        ("vllm-cpu", ("swiglu", "moe"), 1, {}),
        ("vllm-cpu-eager", ("swiglu", "moe"), 1, {}),
        ("vllm-cpu", ("swiglu", "moe", "tp"), 2, {"moe_variant": "engine-op"}),
        ("vllm-cpu", ("swiglu", "moe", "tp"), 2, {}),
        ("vllm-cpu-eager", ("tp",), 2, {}),
        ("vllm", ("swiglu", "moe", "tp"), 2, {"unverified": ["moe"]}),
    ],
)
def test_aligned_experts_keep_no_weight_copy(model, profile, regions, tp, options) -> None:
    hf = _experts_saved(model)
    if options.get("moe_variant") == "engine-op":
        pytest.importorskip("vllm")
    apply_alignment(model, regions=regions, engine=profile, rollout_tp=tp, **options)
    try:
        ours = _experts_saved(model)
    finally:
        remove_alignment(model)
    weight_like = [(shape, d, nb) for shape, d, nb in ours if len(shape) >= 2 and min(shape[-2:]) > T]
    assert weight_like == [], weight_like  # [2I, H] / [H, I] shaped storages: an expert's weights copied
    hf_bytes, our_bytes = sum(nb for *_, nb in hf), sum(nb for *_, nb in ours)
    # fp32 expert GEMM outputs (vllm-cpu) are activations the engine's kernel holds in fp32 too: at most 2.5x HF's
    assert our_bytes <= 2.5 * hf_bytes, (our_bytes, hf_bytes)
    if tp > 1:  # recomputed in backward: less than HF's experts keep (measured 0.12-0.14x)
        assert our_bytes <= 0.5 * hf_bytes, (our_bytes, hf_bytes)
