"""Aligned forwards for the mixture-of-experts modules of MoE families (Qwen2-MoE, Qwen3-MoE).

The generic patcher (:mod:`rlalign_verl.align.patch`) aligns attention, norms and the dense MLPs (including
Qwen2-MoE's shared expert) of MoE families like any other; this module adds the routed experts (swiglu
region: what happens inside each expert) and the router and combine (moe region). Forwards are bound
per instance with the patcher's own ``bind``, so removal restores them with everything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from rlalign_verl.align.forwards import require_bf16
from rlalign_verl.align.regions.moe import fused_gate_sum, mix_experts, route
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles import HF, EngineProfile, MoeRounding

_EXPERT_FIELDS = ("expert_gemm", "expert_act_roundings", "store")  # store: the SwiGLU output's
_ROUTER_FIELDS = (
    "router_softmax",
    "weights_dtype",
    "combine",
    "slot_sum_bf16_max_k",
    "store",
)  # and the sum's


def effective_moe(profile_moe: MoeRounding | None, regions: tuple[str, ...]) -> MoeRounding:
    """The profile's expert rounding where swiglu is aligned and router/combine where moe is, HF's elsewhere;
    an unrounded block sum only with rmsnorm too (the aligned layer hands it on; HF's layer would not). A
    ``"fused"`` block sum is bf16 and needs only moe."""
    fields = {}
    if "swiglu" in regions:
        fields.update({f: getattr(profile_moe, f) for f in _EXPERT_FIELDS})
    if "moe" in regions:
        fields.update({f: getattr(profile_moe, f) for f in _ROUTER_FIELDS})
        if "rmsnorm" in regions or profile_moe.block_sum == "fused":
            fields["block_sum"] = profile_moe.block_sum
    return dataclasses.replace(HF.moe, **fields)


def expert_mix(variant: str) -> Callable:
    """The experts + combine of one (rank's) set of expert weights: the engine's op or the emulation."""
    if variant == "engine-op":
        from rlalign_verl.align.engine_ops.moe_op import engine_experts

        return engine_experts
    return mix_experts


def _experts_forward(rounding: MoeRounding, variant: str = "emulate") -> Callable:
    """The routed experts + combine: emulated in PyTorch, or the engine's own op (``moe_variant``)."""
    mix = expert_mix(variant)

    def forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return mix(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, rounding)

    return forward


def router_fn(profile: EngineProfile, variant: str = "emulate") -> Callable:
    """``route(logits, top_k, renormalize, rounding)``: the PyTorch router, or with ``moe_variant="engine-op"``
    on a profile whose engine compiles its router (``norm_inductor``: vllm-cpu) the Inductor-compiled one, so
    the op gets the engine's routing weights and slot order too (:mod:`.regions.inductor_router`)."""
    if variant != "engine-op" or not profile.norm_inductor:
        return route
    from rlalign_verl.align.regions.inductor_router import inductor_route

    compiled = inductor_route(profile)
    return lambda logits, top_k, renormalize, _rounding: compiled(logits, top_k, renormalize)


def _router_forward(rounding: MoeRounding, profile: EngineProfile, variant: str = "emulate") -> Callable:
    route_fn = router_fn(profile, variant)

    def forward(self: nn.Module, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = nn.functional.linear(hidden_states, self.weight)  # bf16 logits: HF and the engines alike
        require_bf16(logits, "the MoE router logits")
        weights, experts = route_fn(logits, self.top_k, self.norm_topk_prob, rounding)
        return logits, weights, experts

    return forward


def _shared_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's sparse block with ``block_sum="fp32"``: ``R(sigmoid(gate)) * shared + routed`` in fp32."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    shared = self.shared_expert(x)
    _, weights, experts = self.gate(x)
    routed = self.experts(x, experts, weights)
    gate = torch.sigmoid(self.shared_expert_gate(x))  # bf16: the engine stores the [T, 1] sigmoid
    # .float(): Inductor fuses product and sum into the next add + RMSNorm kernel, never rounding them
    out = gate.float() * shared.float() + routed.float()
    return out.reshape(shape)


def _fused_gate_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's sparse block with ``block_sum="fused"``: ``R(sigmoid(x . w_gate) * shared + routed)``."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    shared = self.shared_expert(x)
    _, weights, experts = self.gate(x)
    routed = self.experts(x, experts, weights)
    return fused_gate_sum(x, self.shared_expert_gate.weight, shared, routed).reshape(shape)


def _block_forward(block_sum: str) -> Callable:
    return {"fp32": _shared_block_forward, "fused": _fused_gate_block_forward}[block_sum]


def plan(model: nn.Module, family: ModelFamily, st) -> list[tuple[nn.Module, Callable, tuple]]:
    """The aligned experts (swiglu region) and router (moe region) forwards to bind on ``model``'s instances.

    ``st``: the :class:`~rlalign_verl.align.forwards.AlignmentState`. ``moe_variant="engine-op"``: the experts +
    combine run vLLM CPU's ``cpu_fused_moe`` (:mod:`.engine_ops.moe_op`) and, on ``vllm-cpu``, the router is
    the Inductor-compiled one (:func:`router_fn`).
    """
    regions, profile = st.regions, st.profile
    if family.experts is None or not {"swiglu", "moe"} & set(regions):
        return []
    rounding = effective_moe(profile.moe, regions)
    experts_cls = family.cls("experts")
    router_cls = family.cls("router")
    block_cls = family.cls("moe_block")
    shared = rounding.block_sum in ("fp32", "fused")
    out: list[tuple[nn.Module, Callable, tuple]] = []
    for m in model.modules():
        if isinstance(m, experts_cls):
            out.append((m, _experts_forward, (rounding, st.moe_variant)))
        elif "moe" in regions and isinstance(m, router_cls):
            out.append((m, _router_forward, (rounding, profile, st.moe_variant)))
        elif shared and isinstance(m, block_cls) and getattr(m, "shared_expert", None) is not None:
            out.append((m, _block_forward, (rounding.block_sum,)))
    return out
