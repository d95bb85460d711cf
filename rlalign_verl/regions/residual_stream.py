"""Carry the engine's ``(hidden, residual)`` pair between decoder layers as ONE tensor of the activation dtype.

HF's model loop passes a single ``hidden_states`` tensor from layer to layer; engines pass a pair and
add it inside the next norm. We concatenate the pair on the last dim. An fp32 residual (profiles whose
residual crosses a layer boundary unrounded) is carried as three bf16 *limbs* ``hi + mid + lo`` that
sum back to the fp32 value exactly, so every tensor crossing a layer boundary has the activation
dtype and FSDP2's ``cast_forward_inputs`` (which casts layer inputs to bf16) cannot round it. Gradients
travel the same way, so the fp32 residual gradient is exact too.

Layouts (``H`` = hidden size): ``[..., H]`` plain hidden (first layer), ``[..., 2H]`` hidden + residual of
the same dtype, ``[..., 4H]`` hidden + three limbs of an fp32 residual.
"""

from __future__ import annotations

import torch


def _split_fp32(s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # three bf16 limbs hold all 24 significand bits of an fp32 value: hi + mid + lo == s exactly.
    hi = s.to(dtype)
    rest = s - hi.float()
    mid = rest.to(dtype)
    lo = (rest - mid.float()).to(dtype)
    return hi, mid, lo


def _join_limbs(hi: torch.Tensor, mid: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return (hi.float() + mid.float()) + lo.float()


class _ToLimbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, dtype):  # type: ignore[override]
        return torch.cat(_split_fp32(s, dtype), dim=-1)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _join_limbs(*g.chunk(3, dim=-1)), None


class _FromLimbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, limbs):  # type: ignore[override]
        ctx.dtype = limbs.dtype
        return _join_limbs(*limbs.chunk(3, dim=-1))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.cat(_split_fp32(g.float(), ctx.dtype), dim=-1)


def pack(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """One tensor of ``hidden.dtype`` holding the pair (see module docstring)."""
    if residual.dtype == hidden.dtype:
        return torch.cat((hidden, residual), dim=-1)
    if residual.dtype != torch.float32:
        raise TypeError(f"residual must be {hidden.dtype} or float32, got {residual.dtype}")
    return torch.cat((hidden, _ToLimbs.apply(residual, hidden.dtype)), dim=-1)


def unpack(x: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack`; a plain ``[..., H]`` tensor gives ``(x, None)``."""
    parts = x.shape[-1] // hidden_size
    if x.shape[-1] % hidden_size or parts not in (1, 2, 4):
        raise ValueError(
            f"hidden states of width {x.shape[-1]} are not a packed residual stream of hidden size {hidden_size}"
        )
    if parts == 1:
        return x, None
    hidden, rest = x[..., :hidden_size], x[..., hidden_size:]
    return hidden, (rest if parts == 2 else _FromLimbs.apply(rest))
