"""vLLM CPU's MoE experts as the engine prepares and calls them, built from vLLM's own code (not ours): the truth the
engine-op tests compare with (``tests/align/test_moe_engine_op.py``, ``tests/align/test_tp_moe.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlalign_verl.catalog.profiles import get_profile

BF = torch.bfloat16
MODES = {"vllm-cpu-eager": False, "vllm-cpu": True}
"""Profile -> whether the engine compiles its router."""


def inputs(seed: int, tokens: int, hidden: int, inter: int, experts: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * torch.logspace(-1, 1, tokens)[:, None]).to(BF)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.08).to(BF)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.08).to(BF)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(BF)
    return x, gate_up, down, logits


def vllm_reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The op as vLLM's experts class prepares and calls it (its own padding, packing and wrapper)."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    amx = torch.cpu._is_amx_tile_supported()
    if amx:
        # AMX tiles need the process's XCOMP permission (arch_prctl ARCH_REQ_XCOMP_PERM); in the engine, oneDNN's
        # first bf16 GEMM has requested it before any MoE layer runs; without it the op dies of SIGILL
        torch.cpu._init_amx()
    cls = cpu_moe.X86CPUUnquantizedExperts if amx else cpu_moe.CPUUnquantizedExperts
    experts = object.__new__(cls)
    experts.moe_config = SimpleNamespace(
        intermediate_size_per_partition=down.shape[-1], activation=MoEActivation.SILU
    )
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(gate_up.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(down.clone(), requires_grad=False)
    experts._pad_moe_intermediate(layer)
    out = torch.empty_like(x)
    w13, w2 = (cpu_prepack_moe_weight(w.data, cls.isa) for w in (layer.w13_weight, layer.w2_weight))
    cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", cls.isa)
    return out


def route(logits, top_k: int, profile: str):
    from rlalign_verl.tools.diagnose import engine_floor_moe as em

    w, ids = em.route(logits, top_k, True, compiled=MODES[profile])
    # the profile's combine sees the weights in its own dtype (eager: the engine's bf16 softmax output)
    return (w.to(BF) if get_profile(profile).moe.weights_dtype == "bf16" else w), w, ids
