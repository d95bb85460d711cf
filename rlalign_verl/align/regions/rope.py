"""RoPE region (NeoX / rotate-half layout), parameterised by :class:`~rlalign_verl.catalog.profiles.RopeRounding`.

For an input ``x = [x1 | x2]`` (halves of the head dim) and table ``c, s``::

    out1 = x1*c - x2*s        out2 = x2*c + x1*s

``roundings=3`` rounds each product and the sum to the activation dtype (bf16 eager ops, HF);
``roundings=1`` keeps the rotation in fp32 and rounds once. Products of two bf16 values are exact in
fp32, so the one-rounding result does not depend on FMA contraction.
"""

from __future__ import annotations

import torch

from rlalign_verl.align import kernels
from rlalign_verl.align.regions._precision import autocast_disabled, host_store, rnd, truncate_bf16
from rlalign_verl.catalog.profiles import RopeRounding


def rope_table(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[batch, seq, head_dim]`` for ``position_ids`` ``[batch, seq]``.

    Same formula and ops as HF's rotary embedding before its final cast (fp32 matmul of the
    inverse frequencies with the positions, halves duplicated), so rounding it gives HF's table.
    """
    with autocast_disabled(inv_freq):
        inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(position_ids.device)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        # fp32 table, never rounded here: the profile decides whether the rotation reads R(table).
        return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def _rotate(
    x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rounding: RopeRounding, out_dtype: torch.dtype
):
    """The forward formula on fp32 operands; returns ``out_dtype``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2 = c[..., :half], c[..., half:]
    s1, s2 = s[..., :half], s[..., half:]
    if rounding.roundings == 3:
        # bf16 eager ops (HF's q*cos + rotate_half(q)*sin): each product and the sum rounded.
        o1 = rnd(rnd(x1 * c1, out_dtype) - rnd(x2 * s1, out_dtype), out_dtype)
        o2 = rnd(rnd(x2 * c2, out_dtype) + rnd(x1 * s2, out_dtype), out_dtype)
    else:
        # fused kernels (vLLM rotary_embedding / Inductor / SGLang): fp32 rotation, one rounding below.
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        if out_dtype == torch.bfloat16 and host_store(rounding.store) == "truncate":
            # vLLM CPU rotary_embedding built without AVX512-BF16 stores T(.): low 16 bits dropped
            o1, o2 = truncate_bf16(o1), truncate_bf16(o2)
    # written in x's memory layout (q/k are transposed views of the projection output, as in HF), so that
    # SDPA's output needs no transpose copy before o_proj
    out = torch.empty_like(x, dtype=out_dtype)
    out[..., :half] = o1
    out[..., half:] = o2
    return out


class _RopeFn(torch.autograd.Function):
    """Saves nothing but the (non-differentiable) table; the rotation is linear in ``x``."""

    @staticmethod
    def forward(ctx, x, c, s, rounding, out_dtype, triton):  # type: ignore[override]
        ctx.save_for_backward(c, s)
        ctx.in_dtype = x.dtype
        fused_ok = rounding.store == "nearest"  # the Triton kernel rounds to nearest
        if fused_ok and kernels.available(x, triton) and x.dim() == 4 and c.dim() == 4 and c.shape[1] == 1:
            if out_dtype in (torch.bfloat16, torch.float16):
                return kernels.rope_forward(
                    x, c.float(), s.float(), rounding.roundings, out_dtype
                )  # same formula, fused
        with autocast_disabled(x):
            return _rotate(x.float(), c.float(), s.float(), rounding, out_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        c, s = ctx.saved_tensors
        with autocast_disabled(grad):
            g = grad.float()
            half = g.shape[-1] // 2
            g1, g2 = g[..., :half], g[..., half:]
            # d out1/d x1 = c1, d out2/d x1 = s2; d out1/d x2 = -s1, d out2/d x2 = c2 (roundings: straight-through)
            c, s = c.float(), s.float()
            dx1 = g1 * c[..., :half] + g2 * s[..., half:]
            dx2 = g2 * c[..., half:] - g1 * s[..., :half]
            dx = torch.cat((dx1, dx2), dim=-1).to(ctx.in_dtype)
        return dx, None, None, None, None, None


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rounding: RopeRounding,
    *,
    out_dtype: torch.dtype | None = None,
    unsqueeze_dim: int = 1,
    triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (``[batch, heads, seq, head_dim]``) with table ``cos, sin`` (``[batch, seq, head_dim]``).

    ``out_dtype`` defaults to ``q.dtype``; pass the activation dtype when ``q``/``k`` arrive in
    fp32 (Qwen3's q/k-norm handed over unrounded). With ``rounding.table == "bf16"`` the table is
    rounded to ``out_dtype`` first (a no-op for HF's already-rounded table); with ``"fp32"`` the caller
    must pass the unrounded fp32 table (:func:`rope_table`). ``triton=True`` (``experimental.kernels=triton``) runs
    the forward as the opt-in Triton kernel on CUDA tensors.
    """
    out_dtype = out_dtype or q.dtype
    with autocast_disabled(cos):
        if rounding.table == "bf16":
            # engine's cos_sin_cache: fp32 math, stored in the model dtype (HF's table already is: no copy,
            # and the one table is shared by every layer instead of an fp32 copy saved per layer)
            c, s = cos.to(out_dtype), sin.to(out_dtype)
        else:
            if cos.dtype != torch.float32:
                raise ValueError("an fp32-table RoPE profile needs the unrounded fp32 table (rope_table)")
            c, s = cos, sin
        c, s = c.unsqueeze(unsqueeze_dim), s.unsqueeze(unsqueeze_dim)
    return _RopeFn.apply(q, c, s, rounding, out_dtype, triton), _RopeFn.apply(
        k, c, s, rounding, out_dtype, triton
    )
