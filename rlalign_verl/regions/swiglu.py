"""SwiGLU region ``silu(gate) * up``, parameterised by :class:`~rlalign_verl.profiles.SwigluRounding`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..profiles import SwigluRounding
from ._precision import fp32_math, rnd


class _SwigluFn(torch.autograd.Function):
    """Saves only the bf16 ``gate`` and ``up``; ``silu`` and its derivative are recomputed in backward."""

    @staticmethod
    def forward(ctx, gate, up, roundings):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        dtype = gate.dtype
        if kernels.available(gate) and dtype in (torch.bfloat16, torch.float16):
            return kernels.swiglu_forward(gate, up, roundings)  # same formula, one fused Triton pass
        with fp32_math(gate):
            a = F.silu(gate.float())
            if roundings == 2:
                # eager act_and_mul (HF act_fn(gate) * up; vLLM CUDA kernel): silu output stored in bf16.
                a = rnd(a, dtype)
            # the product is rounded once into the output buffer (every path).
            return (a * up.float()).to(dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        with fp32_math(grad):
            g, u, go = gate.float(), up.float(), grad.float()
            sig = torch.sigmoid(g)
            d_up = go * g * sig
            d_gate = go * u * sig * (1.0 + g * (1.0 - sig))
        return d_gate.to(gate.dtype), d_up.to(up.dtype), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, rounding: SwigluRounding) -> torch.Tensor:
    """``R(silu(g) * u)`` (1 rounding) or ``R(R(silu(g)) * u)`` (2 roundings), in ``gate.dtype``."""
    return _SwigluFn.apply(gate, up, rounding.roundings)
