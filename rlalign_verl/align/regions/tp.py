"""TP region: the row-parallel projections (``o_proj``, ``down_proj``) as the rollout engine computes them
under tensor parallelism of size N, parameterised by :class:`~rlalign_verl.catalog.profiles_tp.TpReduction`.

The engine's ``RowParallelLinear`` splits the input dimension K into N contiguous slices (rank r holds the
heads / intermediate columns ``r*K/N .. (r+1)*K/N``); each rank's GEMM stores its partial product in bf16,
and the all-reduce sums the partials. The trainer's single GEMM over all of K rounds once instead: that one
rounding location is what separates a TP>1 rollout from the trainer. Backward is ``nn.Linear``'s: the split
changes where the forward rounds, not the gradient's math (:class:`_RowParallelFn`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlalign_verl.align.forwards import mlp_hidden
from rlalign_verl.align.moe_patch import effective_moe, expert_mix
from rlalign_verl.align.regions._precision import store_as
from rlalign_verl.align.regions.moe import fused_gate_sum, mix_experts
from rlalign_verl.base.errors import ComputeDtypeError, UnsupportedModelError
from rlalign_verl.catalog import profiles_tp
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles import HF, MoeRounding
from rlalign_verl.catalog.profiles_tp import TpReduction

ROW_PARALLEL = (("attention", "o_proj"), ("mlp", "down_proj"))
"""``(family role, linear attribute)``: the projections vLLM's model files build as ``RowParallelLinear`` (qwen2.py,
qwen3.py, llama.py, qwen2_moe.py's shared expert), named alike in every family here."""


class _RowParallelFn(torch.autograd.Function):
    """Forward: the engine's split GEMM and reduction. Backward: ``nn.Linear``'s (one GEMM each for the input and
    the weight gradient). Exact, not an approximation: every partial receives the output's bf16 gradient
    unchanged (bf16 -> fp32 -> bf16 through the fp32 sum is lossless), and the K slices' input and weight
    gradients are disjoint column blocks of the unsplit ones; autograd through the slices would build them from
    ``tp`` zero-filled full-size buffers instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp, reduction, store):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with torch.no_grad():
            return reduce_partials(_rank_partials(x, weight, bias, tp), reduction, store)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dtype = g.dtype  # the compute dtype (bf16 weights, or fp32 masters under bf16 autocast)
        gx = g @ weight.to(dtype) if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            gw = g.reshape(-1, g.shape[-1]).t() @ x.to(dtype).reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0)
        return gx, gw, gb, None, None, None


class _RowParallelPartsFn(torch.autograd.Function):
    """The ranks' bf16 partial products of a row-parallel projection, stacked ``[tp, ..., N]`` and not reduced (a
    layer whose all-reduce comes later: Qwen2-MoE's shared expert, ``reduce_results=False``). Backward: each rank's
    K slice gets its own partial's gradient (disjoint column blocks of the input and weight gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.tp = bias is not None, tp
        with torch.no_grad():
            return torch.stack(_rank_partials(x, weight, bias, tp))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        tp, dtype = ctx.tp, g.dtype
        k = weight.shape[1] // tp
        cols = [slice(r * k, (r + 1) * k) for r in range(tp)]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.cat([g[r] @ weight[:, c].to(dtype) for r, c in enumerate(cols)], dim=-1)
        if ctx.needs_input_grad[1]:
            flat = [g[r].reshape(-1, g.shape[-1]).t() for r in range(tp)]
            gw = torch.cat(
                [f @ x[..., c].to(dtype).reshape(-1, k) for f, c in zip(flat, cols, strict=True)], dim=1
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g[0].reshape(-1, g.shape[-1]).sum(0)
        return gx, gw, gb, None


def row_parallel_parts(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int
) -> list[torch.Tensor]:
    """The ``tp`` ranks' bf16 partial products of ``x @ weight.T (+ bias)`` (rank order), before any all-reduce."""
    return list(_RowParallelPartsFn.apply(x, weight, bias, tp).unbind(0))


def _rank_partials(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int
) -> list[torch.Tensor]:
    """Rank r's GEMM over its K slice, a bf16 partial each (rank order); the bias is added on rank 0 only, in its
    GEMM. The engine's partials are bf16: an fp32 (or fp16) computation has nothing to mirror."""
    k = weight.shape[1] // tp
    parts = [
        F.linear(x[..., r * k : (r + 1) * k], weight[:, r * k : (r + 1) * k], bias if r == 0 else None)
        for r in range(tp)
    ]
    if parts[0].dtype is not torch.bfloat16:
        raise ComputeDtypeError(
            f"the tp region's projection computes in {str(parts[0].dtype).removeprefix('torch.')}, but it "
            "mirrors a bf16 engine; run the model in bf16 (or under bf16 autocast), or turn alignment off"
        )
    return parts


def reduce_partials(parts: list[torch.Tensor], reduction: TpReduction, store: str) -> torch.Tensor:
    """The all-reduce of the ranks' bf16 partial outputs ``parts`` (rank order), as ``reduction`` sums them and
    ``store`` (resolved for this host) stores the sum. Differentiable: the sum's gradient reaches every partial."""
    if reduction.accumulate == "fp32":
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()  # the all-reduce accumulates in fp32, ranks 0..N-1 (rank 0's order)
        return store_as(acc, store, parts[0].dtype)  # and stores the sum once
    out = parts[0]
    for p in parts[1:]:
        out = store_as(out.float() + p.float(), store, out.dtype)  # bf16 per hop: a rounding per add
    return out


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tp: int,
    reduction: TpReduction,
    store: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` computed as ``tp`` ranks compute it and ``reduction`` sums it; ``store``: the
    reduction's store already resolved for this host (:meth:`TpReduction.host_store`), else resolved here."""
    if tp == 1:
        return F.linear(x, weight, bias)
    return _RowParallelFn.apply(x, weight, bias, tp, reduction, store or reduction.host_store())


def row_parallel_forward(tp: int, reduction: TpReduction) -> Callable:
    """The forward bound on a row-parallel ``nn.Linear`` (:func:`rlalign_verl.align.binding.bind`)."""

    store = reduction.host_store()  # this host's store, settled once when the forward is built

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, tp, reduction, store)

    return forward


def check_row_parallel(module: nn.Module, where: str, how: str = "splits") -> None:
    """The tp region replaces a plain ``nn.Linear``'s forward (or reads its weight); a wrapper (a PEFT LoRA layer, a
    quantized linear) computes more than ``weight``/``bias``, which the split would silently drop: refused in one
    line."""
    if type(module) is not nn.Linear:
        raise UnsupportedModelError(
            f"the tp region {how} {where} as a plain nn.Linear, but it is a {type(module).__module__}."
            f"{type(module).__name__} (LoRA adapters or a quantized layer are not modelled under tensor parallelism); "
            "merge the adapters into the weights, or drop tp from the regions"
        )


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
    every expert's intermediate columns ``r*I/tp .. (r+1)*I/tp`` (:func:`~.regions.moe.rank_views`), runs the
    experts and the combine on them (``mix``: emulated or the engine's op) and stores its partial output in bf16.
    Recomputed in backward (:class:`_ExpertPartsFn`)."""
    return list(_ExpertPartsFn.apply(x, experts, weights, gate_up, down, rounding, mix, tp).unbind(0))


class _ExpertPartsFn(torch.autograd.Function):
    """The ranks' expert outputs, stacked ``[tp, T, H]``, recomputed in backward. Forward runs the ranks (``mix``:
    emulated or the engine's op) without autograd and keeps only its inputs (``x``, the routing; the expert weights
    are parameters). Backward reruns the emulated ranks (:func:`~.regions.moe.mix_experts`) one at a time with
    autograd and sums their gradients in rank order: the activations of one rank (its H-wide ones as large as the
    unsplit experts') exist at a time, during the block's backward only, instead of every rank's from forward on."""

    @staticmethod
    def forward(ctx, x, experts, weights, gate_up, down, rounding, mix, tp):  # type: ignore[override]
        ctx.save_for_backward(x, experts, weights, gate_up, down)
        ctx.rounding, ctx.tp = rounding, tp
        with torch.no_grad():
            return torch.stack(
                [mix(x, experts, weights, gate_up, down, rounding, rank=(r, tp)) for r in range(tp)]
            )

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        saved = ctx.saved_tensors  # unpacked once: under checkpointing a second unpack is an error
        needs = ctx.needs_input_grad[:5]
        wanted = [i for i, n in enumerate(needs) if n]
        total: dict[int, torch.Tensor] = {}
        for r in range(ctx.tp):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(n) for t, n in zip(saved, needs, strict=True)]
                y = mix_experts(*leaves, ctx.rounding, rank=(r, ctx.tp))
                got = torch.autograd.grad(y, [leaves[i] for i in wanted], g[r]) if wanted else ()
            for i, gr in zip(wanted, got, strict=True):
                # .float(): the ranks' gradients summed in fp32 and rounded once (autograd would round per add)
                total[i] = gr.float() if r == 0 else total[i] + gr.float()
        return (*(total[i].to(saved[i].dtype) if i in total else None for i in range(5)), None, None, None)


def rank_block_sum(block_sum: str, x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                   routed: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One rank's ``sigmoid(x . w_gate) * shared + routed`` (Qwen2-MoE at rollout TP > 1), stored in bf16 as the
    all-reduce's input: ``shared`` and ``routed`` are the rank's bf16 partials; ``block_sum`` says how the engine
    rounds the rest (:class:`~rlalign_verl.catalog.profiles_moe.MoeRounding`)."""
    if block_sum == "fused":
        return fused_gate_sum(x, gate_weight, shared, routed)  # one fused kernel per rank, one store
    # bf16 logit, bf16 sigmoid: the engine's [T, 1] gate
    gate = torch.sigmoid(F.linear(x, gate_weight))
    if block_sum == "fp32":
        # .float(): Inductor fuses product and sum and stores them once, as the all-reduce's bf16 input
        return (gate.float() * shared.float() + routed.float()).to(shared.dtype)
    # eager (and HF): Qwen2MoeMLP.forward's F.sigmoid(gate) * out rounds, then MoERunner's shared + fused rounds
    return gate * shared + routed


def split_experts_forward(rounding: MoeRounding, variant: str, tp: int, reduction: TpReduction) -> Callable:
    """The routed experts + combine (emulated or the engine's op, ``variant``) as ``tp`` ranks compute them
    (:func:`split_experts`)."""
    mix, store = expert_mix(variant), reduction.host_store()

    def forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return split_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                             rounding, mix=mix, tp=tp, reduction=reduction, store=store)  # fmt: skip

    return forward


def shared_block_forward(
    rounding: MoeRounding, block_sum: str, variant: str, hidden: Callable, tp: int, reduction: TpReduction
) -> Callable:
    """Qwen2-MoE's sparse block at rollout TP > 1 as vLLM computes it: the shared expert's down projection is
    row-parallel without its own all-reduce (``reduce_results=False``), so each rank adds its gated shared partial
    to its routed partial (:func:`rank_block_sum`) and one all-reduce sums the ranks
    (``_maybe_reduce_final_output``). ``hidden(mlp, x)``: the shared expert's SwiGLU output, as the (aligned or HF)
    MLP forms it."""
    store = reduction.host_store()  # this host's all-reduce store, settled once
    mix = expert_mix(variant)

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
    """The row-parallel projections to split (:data:`ROW_PARALLEL`) and, on MoE models, the routed experts and
    Qwen2-MoE's shared-expert blocks, each checked before any is bound; none at rollout TP 1 (the engine's
    projections are then the trainer's). The experts and blocks carry the swiglu/moe regions' rounding and replace
    those regions' bindings of the same modules (the patcher keeps a later row's binding)."""
    tp = st.spec.rollout_tp
    if tp == 1:
        return []
    reduction = profiles_tp.reduction(st.profile)  # not None: the request check refuses an engine without one
    blocks = _shared_expert_blocks(model, family)
    deferred = {id(b.shared_expert.down_proj) for _, b in blocks}  # reduced with their block
    split = [(family.cls(role), attr) for role, attr in ROW_PARALLEL]
    out: list[tuple[nn.Module, Callable, tuple]] = []
    for name, m in model.named_modules():
        for cls, attr in split:
            if isinstance(m, cls):
                linear = getattr(m, attr)
                check_row_parallel(linear, f"{name}.{attr}")  # a deferred one is split by its block's forward
                if id(linear) not in deferred:
                    out.append((linear, row_parallel_forward, (tp, reduction)))
    if family.experts is None:
        return out
    regions = st.regions
    # the experts split as the engine's ranks do, whatever else is aligned (HF's rounding if nothing)
    rounding = effective_moe(st.profile.moe, regions)
    experts_cls = family.cls("experts")
    out += [(m, split_experts_forward, (rounding, st.moe_variant, tp, reduction))
            for m in model.modules() if isinstance(m, experts_cls)]  # fmt: skip
    # before the all-reduce each rank's sum is stored in bf16 whatever the path, so the profile's block sum
    # applies with moe alone (at TP 1 the fp32 one needs rmsnorm to hand it on)
    block_sum = st.profile.moe.block_sum if "moe" in regions else HF.moe.block_sum
    for name, b in blocks:
        check_row_parallel(b.shared_expert_gate, f"{name}.shared_expert_gate", how="reads")
        out.append(
            (b, shared_block_forward, (rounding, block_sum, st.moe_variant, mlp_hidden(st), tp, reduction))
        )
    return out


def _shared_expert_blocks(model: nn.Module, family: ModelFamily) -> list[tuple[str, nn.Module]]:
    """The MoE blocks with a shared expert (Qwen2-MoE), whose ``down_proj`` all-reduce the engine defers to the
    block's (``reduce_results=False``)."""
    if family.moe_block is None:
        return []
    block_cls = family.cls("moe_block")
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, block_cls) and getattr(m, "shared_expert", None) is not None
    ]
