"""Carry what the engine's next norm reads between decoder layers, as ONE tensor of the activation dtype.

HF's model loop passes a single ``hidden_states`` tensor from layer to layer; engines pass a
``(hidden, residual)`` pair and add it inside the next norm (``s = h + r`` in fp32). Each layer here
hands on the least that the next norm needs, chosen by the profile (:func:`carry_for`):

- ``ROUNDED_SUM`` ``[..., H]``: ``R(h + r)`` — the next norm reads only the rounded sum (variance,
  normalisation and the stored residual all come from it: HF, vLLM's eager CUDA kernels);
- ``PAIR`` ``[..., 2H]``: ``h`` and ``r`` side by side — the next norm reads the fp32 sum but stores a
  bf16 residual (vLLM CPU eager, SGLang);
- ``FP32_SUM`` ``[..., 3H]``: the fp32 sum ``h + r`` as three bf16 *limbs* ``hi + mid + lo`` that add
  back to it exactly — the residual stream crosses the layer boundary in fp32 (compiled vLLM).

So every tensor crossing a layer boundary has the activation dtype and FSDP2's
``cast_forward_inputs`` (which casts layer inputs to bf16) cannot round it. Gradients travel the same
way, so the fp32 gradient of an fp32 sum is exact too. A ``[..., H]`` tensor is also what the first
layer receives (the embedding): in both cases the norm's input *is* the sum.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..profiles import EngineProfile, Residual, Source


class Carry(str, Enum):
    ROUNDED_SUM = "rounded_sum"
    PAIR = "pair"
    FP32_SUM = "fp32_sum"


def carry_for(profile: EngineProfile) -> Carry:
    """What crosses a layer boundary for ``profile``'s residual add + RMSNorm."""
    if profile.residual is not Residual.EVERY_ADD:
        return Carry.FP32_SUM
    if profile.norm.variance is Source.ROUNDED_SUM and profile.norm.normalize is Source.ROUNDED_SUM:
        return Carry.ROUNDED_SUM
    return Carry.PAIR


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


def pack(hidden: torch.Tensor, residual: torch.Tensor, carry: Carry) -> torch.Tensor:
    """One tensor of ``hidden.dtype`` carrying ``hidden + residual`` as ``carry`` says."""
    if carry is Carry.PAIR:
        return torch.cat((hidden, residual.to(hidden.dtype)), dim=-1)
    s = hidden.float() + residual.float()  # the fp32 sum the engine's next norm forms
    if carry is Carry.ROUNDED_SUM or hidden.dtype == torch.float32:
        return s.to(hidden.dtype)
    return _ToLimbs.apply(s, hidden.dtype)


def unpack(x: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack`: ``(h, r)`` for a pair, else ``(sum, None)`` (fp32 for limbs)."""
    parts = x.shape[-1] // hidden_size
    if x.shape[-1] % hidden_size or parts not in (1, 2, 3):
        raise ValueError(
            f"hidden states of width {x.shape[-1]} are not a packed residual stream of hidden size {hidden_size}"
        )
    if parts == 1:
        return x, None
    if parts == 2:
        return x[..., :hidden_size], x[..., hidden_size:]
    return _FromLimbs.apply(x), None
