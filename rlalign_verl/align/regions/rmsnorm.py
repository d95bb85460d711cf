"""Residual-add + RMSNorm region, parameterised by :class:`~rlalign_verl.catalog.profiles.NormRounding`.

Engines never add the residual inside the decoder layer: the *next* norm does
``s = h + r`` (fp32), keeps a residual (``R(s)`` or ``s``) and normalises. :func:`add_rms_norm` is that
fused step; :func:`rms_norm` is the plain norm (first input norm, Qwen3 q/k-norm).

Backward saves only the inputs (bf16 ``h``, the residual, the weight) and recomputes ``s`` and
``rsqrt`` in fp32; roundings are treated as straight-through.
"""

from __future__ import annotations

import torch

from rlalign_verl.align.regions._precision import autocast_disabled, rnd
from rlalign_verl.catalog.profiles import Mean, NormRounding, Source


def rsqrt_mean_sq(v: torch.Tensor, eps: float, mean: Mean) -> torch.Tensor:
    if mean is Mean.MEAN:
        var = v.pow(2).mean(-1, keepdim=True)  # torch.mean, as HF and vLLM's native ops
    else:
        var = v.pow(2).sum(-1, keepdim=True) / v.shape[-1]  # CUDA kernels: block sum / N
    return torch.rsqrt(var + eps)


def normalize_rows(
    n: torch.Tensor, rt: torch.Tensor, w: torch.Tensor, rounding: NormRounding, dtype: torch.dtype
):
    if rounding.output_roundings == 2:
        # eager: normalised value stored in bf16 before the weight multiply (HF: weight * x.to(bf16)).
        return (rnd(n * rt, dtype) * w).to(dtype)
    # fused / compiled: n * rt * w in fp32, one rounding into the output buffer.
    return (n * rt * w).to(dtype)


def norm_backward(n, rt, w, gy):
    """d(n*rt(n)*w)/dn and the per-element weight gradient, fp32 (both roundings straight-through)."""
    xhat = n * rt
    gw = gy * xhat
    gx = gy * w
    inner = (gx * xhat).sum(-1, keepdim=True) / n.shape[-1]
    dn = rt * (gx - xhat * inner)
    return dn, gw


def _reduce_to_weight(gw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gw.reshape(-1, gw.shape[-1]).sum(0).to(weight.dtype)


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, rounding, keep_fp32):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.rounding = eps, rounding
        dtype = x.dtype
        with autocast_disabled(x):
            v = x.float()
            rt = rsqrt_mean_sq(v, eps, rounding.mean)
            if keep_fp32:
                # Inductor fuses q/k-norm into RoPE: the normalised value is never stored in bf16.
                return v * rt * weight.float()
            return normalize_rows(v, rt, weight.float(), rounding, dtype)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        with autocast_disabled(gy):
            v = x.float()
            rt = rsqrt_mean_sq(v, ctx.eps, ctx.rounding.mean)
            dx, gw = norm_backward(v, rt, weight.float(), gy.float())
        return dx.to(x.dtype), _reduce_to_weight(gw, weight), None, None, None


class _AddRmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, residual, weight, eps, rounding, round_residual, out_dtype):  # type: ignore[override]
        ctx.eps, ctx.rounding = eps, rounding
        ctx.h_dtype = h.dtype
        ctx.r_dtype = None if residual is None else residual.dtype
        dtype = out_dtype or h.dtype
        with autocast_disabled(h):
            # the fp32 sum every fused add+norm forms (given whole when the residual is None)
            s = h.float() if residual is None else h.float() + residual.float()
        # backward needs only s: saving it (4 B/element) rather than h and the residual keeps neither the
        # packed layer input (h is a view of it) nor the fp32 residual alive
        ctx.save_for_backward(s, weight)
        with autocast_disabled(h):
            s_r = rnd(s, dtype)
            var_src = s if rounding.variance is Source.FP32_SUM else s_r
            norm_src = s if rounding.normalize is Source.FP32_SUM else s_r
            rt = rsqrt_mean_sq(var_src, eps, rounding.mean)
            y = normalize_rows(norm_src, rt, weight.float(), rounding, dtype)
            # residual handed on: stored in bf16 (eager kernels, graph-split boundary) or kept in fp32 (one graph).
            new_residual = s_r.to(dtype) if round_residual else s
        ctx.residual_dtype = new_residual.dtype
        return y, new_residual

    @staticmethod
    def backward(ctx, gy, g_res):  # type: ignore[override]
        s, weight = ctx.saved_tensors
        with autocast_disabled(gy):
            rt = rsqrt_mean_sq(s, ctx.eps, ctx.rounding.mean)
            ds, gw = norm_backward(s, rt, weight.float(), gy.float())
            if g_res is not None:
                ds = ds + g_res.float()
        d_res = None if ctx.r_dtype is None else ds.to(ctx.r_dtype)
        return ds.to(ctx.h_dtype), d_res, _reduce_to_weight(gw, weight), None, None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rounding: NormRounding, *, keep_fp32: bool = False
) -> torch.Tensor:
    """Plain RMSNorm of ``x`` in ``x.dtype`` (``keep_fp32``: return the unrounded fp32 value)."""
    return _RmsNormFn.apply(x, weight, eps, rounding, keep_fp32)


def add_rms_norm(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rounding: NormRounding,
    *,
    round_residual: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``s = h + residual`` then RMSNorm; returns ``(normed in h.dtype, residual for the next norm)``.

    ``residual=None``: ``h`` is the sum itself (bf16, or the fp32 sum carried between layers); the output
    is then rounded to ``out_dtype`` (default ``h.dtype``). The returned residual is ``R(s)`` when
    ``round_residual`` else the fp32 ``s``.
    """
    return _AddRmsNormFn.apply(h, residual, weight, eps, rounding, round_residual, out_dtype)
