"""Mixture-of-experts math, parameterised by :class:`~rlalign_verl.catalog.profiles.MoeRounding`.

:func:`route` is the router (top-k selection and routing weights from the gate logits),
:func:`mix_experts` runs the selected experts and combines their outputs, and :func:`fused_gate_sum` is
Qwen2-MoE's shared + routed sum as one fused kernel computes it (``MoeRounding.block_sum="fused"``). Both are plain
differentiable PyTorch (no custom backward): the roundings are ``x.to(bf16)`` casts, whose gradient is
the identity cast back, i.e. straight-through as in the other regions. The expert selection itself
(``topk`` indices) carries no gradient, exactly as in HF.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlalign_verl.align.regions._precision import autocast_disabled, rnd, store_as
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.catalog.profiles import MoeRounding, SwigluRounding


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, rounding: MoeRounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], experts [T, k])`` from the gate logits ``[T, E]`` (activation dtype)."""
    dtype = logits.dtype
    with autocast_disabled(logits):
        if rounding.router_softmax == "topk":
            # vLLM CPURouter._softmax_topk: top-k of the bf16 logits, then softmax over those k only
            vals, idx = torch.topk(logits, top_k, dim=-1)
            if renormalize:
                w = torch.softmax(vals.float(), dim=-1)  # .float(): torch.softmax on bf16 computes in fp32
            elif rounding.weights_dtype == "bf16":
                # eager bf16 ops, each output rounded: R(exp(R(v - R(logsumexp(logits)))))
                w = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
            else:
                # compiled: logsumexp is a reduction whose bf16 output buffer is kept; the rest stays fp32
                lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True).to(dtype)
                w = (vals.float() - lse.float()).exp()
        else:
            # HF TopKRouter: fp32 softmax over all experts, top-k of the probabilities, divide by their sum
            probs = torch.softmax(logits.float(), dim=-1)  # .float(): HF's softmax(..., dtype=torch.float)
            w, idx = torch.topk(probs, top_k, dim=-1)
            if renormalize:
                w = w / w.sum(dim=-1, keepdim=True)
        if rounding.weights_dtype == "bf16":
            w = w.to(dtype)  # HF: .to(router_logits.dtype); vLLM CPU: bf16 softmax output
    return w, idx


class _Fp32Gemm(torch.autograd.Function):
    """``a.float() @ w.float().t()``: a GEMM of bf16 operands into an fp32 accumulator, as the fused expert kernels
    compute it. Only the bf16 ``a`` and ``w`` are kept for backward (``w``: a view of the expert parameter, no
    storage of its own); autograd through the ``.float()`` copies would keep an fp32 copy of every expert's weights
    (twice their bf16 size) until backward. Backward recomputes the casts: the same fp32 math."""

    @staticmethod
    def forward(ctx, a, w):  # type: ignore[override]
        ctx.save_for_backward(a, w)
        return a.float() @ w.float().t()  # .float(): bf16 products, fp32 accumulation

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        a, w = ctx.saved_tensors
        ga = (g @ w.float()).to(a.dtype) if ctx.needs_input_grad[0] else None
        gw = (a.float().t() @ g).t().to(w.dtype) if ctx.needs_input_grad[1] else None
        return ga, gw


def _fp32_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _Fp32Gemm.apply(a, w)


def _gate_up(x: torch.Tensor, w13: tuple[torch.Tensor, ...], gemm) -> torch.Tensor:
    """``x`` times the gate rows then the up rows: one GEMM per part of ``w13``, outputs side by side. Each output
    element is its own dot product over ``H``, so the parts' GEMMs give the elements one GEMM over their
    concatenation gives (``tests/align/test_tp_moe.py`` compares them bit for bit)."""
    if len(w13) == 1:
        return gemm(x, w13[0])
    return torch.cat([gemm(x, w) for w in w13], dim=-1)


def _expert(
    x: torch.Tensor, w13: tuple[torch.Tensor, ...], down: torch.Tensor, rounding: MoeRounding
) -> torch.Tensor:
    """One expert on its tokens: ``down(swiglu(gate_up(x)))``, fp32 or bf16 as ``expert_gemm`` says. ``w13``: its
    ``[2I, H]`` gate_up, or a rank's gate rows and up rows as two views (:func:`rank_views`)."""
    inter = down.shape[-1]
    if rounding.expert_gemm == "fp32":
        # fused expert kernel (vLLM cpu_fused_moe): bf16 products accumulated in fp32, the GEMM output is
        # never stored in bf16; only the SwiGLU output (the second GEMM's operand) is rounded
        gu = _gate_up(x, w13, _fp32_gemm)
        g, u = gu[..., :inter], gu[..., inter:]
        a = F.silu(g)
        if rounding.expert_act_roundings == 2:
            a = rnd(a, x.dtype)
        a = store_as(a * u, rounding.store, x.dtype)  # the kernel's bf16 store: R, or T without AVX512-BF16
        return _fp32_gemm(a, down)  # the down GEMM's fp32 accumulator, not rounded here
    g, u = _gate_up(x, w13, F.linear).chunk(2, dim=-1)
    a = swiglu(g, u, SwigluRounding(roundings=rounding.expert_act_roundings))
    if rounding.combine == "slot":
        return _fp32_gemm(a, down)  # the down GEMM's fp32 accumulator meets the weight
    return F.linear(a, down)


def mix_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rounding: MoeRounding,
    rank: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``sum_k w_k * expert_{e_k}(x)`` per token, rounded where ``rounding`` says; ``x`` is ``[T, H]``.

    ``gate_up``: ``[E, 2I, H]`` (gate rows first), ``down``: ``[E, H, I]``, as HF stores them. Experts run
    in ascending order, as HF's loop (the order of the bf16 running sum). ``rank=(r, tp)``: tensor-parallel rank
    ``r``'s part, on its slice of every expert (:func:`rank_views`: views, so backward keeps no weight copy).
    """
    w13, down = rank_views(gate_up, down, *rank) if rank is not None else ((gate_up,), down)
    if rounding.combine == "slot":
        return _mix_by_slot(x, experts, weights, w13, down, rounding)
    dtype = x.dtype
    fp32_combine = rounding.combine == "fp32"
    with autocast_disabled(x):
        out = torch.zeros(x.shape, dtype=torch.float32 if fp32_combine else dtype, device=x.device)
        hit = torch.unique(experts).tolist()
        for e in hit:
            token, slot = torch.where(experts == e)
            d = _expert(x[token], tuple(w[e] for w in w13), down[e], rounding)
            w = weights[token, slot, None]
            if fp32_combine:
                # w * d in fp32, summed over the slots in fp32, one rounding at the end
                out.index_add_(0, token, d.float() * w.float())
            else:
                # HF: the product rounded, then added into the bf16 output buffer (each add rounds)
                out.index_add_(0, token, (d.to(dtype) * w.to(dtype)).to(dtype))
        return store_as(out, rounding.store, dtype) if fp32_combine else out


def _mix_by_slot(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w13: tuple[torch.Tensor, ...],
    down: torch.Tensor,
    rounding: MoeRounding,
) -> torch.Tensor:
    """``combine="slot"``: ``R(w_k * d_k)`` per slot (fp32 ``d_k``), slots summed as ``moe_sum`` does."""
    dtype = x.dtype
    top_k = experts.shape[-1]
    with autocast_disabled(x):
        slots = torch.zeros((*experts.shape, x.shape[-1]), dtype=dtype, device=x.device)  # [T, k, H]
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            d = _expert(x[token], tuple(w[e] for w in w13), down[e], rounding)
            # the fp32 accumulator times the fp32 routing weight, rounded once when stored
            slots = slots.index_put((token, slot), (d.float() * weights[token, slot, None].float()).to(dtype))
        if top_k > rounding.slot_sum_bf16_max_k:
            return slots.float().sum(dim=1).to(dtype)  # fp32 accumulation, one rounding
        out = slots[:, 0]
        for k in range(1, top_k):
            out = out + slots[:, k]  # bf16 + bf16: each add rounds (a scalar_t running sum)
        return out


def fused_gate_sum(
    x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor
) -> torch.Tensor:
    """``R(sigmoid(x . w_gate) * shared + routed)`` with one rounding (``block_sum="fused"``).

    ``x``: the block input ``[T, H]``; ``gate_weight``: the shared-expert gate's ``[1, H]`` row; ``shared`` and
    ``routed``: the bf16 ``[T, H]`` outputs. SGLang's ``fused_gate_sigmoid_mul_add`` (Triton) loads all of
    them as fp32, reduces ``x * w`` in fp32, and stores the result once into the bf16 routed buffer.
    """
    dtype = x.dtype
    with autocast_disabled(x):
        # .float(): the kernel's tl.sum(h * w) in fp32, the gate logit is never rounded to bf16
        logit = x.float() @ gate_weight.float().t()
        # .float(): sigmoid, product and sum stay in fp32 registers until the one store
        out = torch.sigmoid(logit) * shared.float() + routed.float()
        return out.to(dtype)


def rank_views(
    gate_up: torch.Tensor, down: torch.Tensor, r: int, tp: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rank ``r``'s expert weights as views of ``gate_up`` and ``down`` (no copy): ``((gate [E, I/tp, H], up
    [E, I/tp, H]), w2 [E, H, I/tp])``, the two halves of :func:`rank_experts`'s ``w13`` and its ``w2``."""
    inter = down.shape[-1]
    k = inter // tp
    return (gate_up[:, r * k : (r + 1) * k], gate_up[:, inter + r * k : inter + (r + 1) * k]), down[
        :, :, r * k : (r + 1) * k
    ]


def rank_experts(
    gate_up: torch.Tensor, down: torch.Tensor, r: int, tp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s expert weights as vLLM's ``FusedMoE`` loader fills them (``_load_w13``/``_load_w2`` narrow by
    ``tp_rank``): ``w13 [E, 2I/tp, H]`` = its slice of the gate rows, then the same slice of the up rows of
    ``gate_up [E, 2I, H]`` (a copy: the engine's op takes one packed tensor); ``w2 [E, H, I/tp]`` = the same
    columns of ``down``."""
    (gate, up), w2 = rank_views(gate_up, down, r, tp)
    return torch.cat((gate, up), dim=1), w2
