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

from rlalign_verl.align.regions._precision import host_store, store_as
from rlalign_verl.base.errors import ComputeDtypeError, UnsupportedModelError
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles_tp import TpReduction


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
    reduction's store already resolved for this host (:func:`._precision.host_store`), else resolved here."""
    if tp == 1:
        return F.linear(x, weight, bias)
    return _RowParallelFn.apply(x, weight, bias, tp, reduction, store or host_store(reduction.store))


def row_parallel_forward(tp: int, reduction: TpReduction) -> Callable:
    """The forward bound on a row-parallel ``nn.Linear`` (:func:`rlalign_verl.align.binding.bind`)."""

    store = host_store(reduction.store)  # this host's store, settled once when the forward is built

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


def plan(model: nn.Module, family: ModelFamily, st) -> list[tuple[nn.Module, Callable, tuple]]:
    """The row-parallel projections to split (``family.row_parallel``), each checked before any is bound;
    none at rollout TP 1 (the engine's projections are then the trainer's)."""
    tp = st.spec.rollout_tp
    if tp == 1:
        return []
    split = [(family.cls(role), attr) for role, attr in family.row_parallel]
    deferred = deferred_reduce(model, family)  # reduced with their MoE block (moe_patch.plan)
    out: list[tuple[nn.Module, Callable, tuple]] = []
    for name, m in model.named_modules():
        for cls, attr in split:
            if isinstance(m, cls):
                linear = getattr(m, attr)
                check_row_parallel(linear, f"{name}.{attr}")  # a deferred one is split by its block's forward
                if id(linear) not in deferred:
                    out.append((linear, row_parallel_forward, (tp, st.profile.tp)))
    return out


def deferred_reduce(model: nn.Module, family: ModelFamily) -> set[int]:
    """``id``s of the row-parallel projections whose all-reduce the engine defers to their MoE block's: Qwen2-MoE's
    shared expert ``down_proj`` (``reduce_results=False``), computed rank by rank with the routed experts by the
    block's forward (:func:`rlalign_verl.align.moe_patch.plan`)."""
    if family.moe_block is None:
        return set()
    block_cls = family.cls("moe_block")
    return {
        id(m.shared_expert.down_proj)
        for m in model.modules()
        if isinstance(m, block_cls) and getattr(m, "shared_expert", None) is not None
    }
