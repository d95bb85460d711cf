"""SwiGLU region ``silu(gate) * up``, parameterised by :class:`~rlalign_verl.catalog.profiles.SwigluRounding`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlalign_verl.align import kernels
from rlalign_verl.align.regions._precision import autocast_disabled, rnd
from rlalign_verl.catalog.profiles import SwigluRounding


class _SwigluFn(torch.autograd.Function):
    """Saves only the bf16 ``gate`` and ``up``; ``silu`` and its derivative are recomputed in backward."""

    @staticmethod
    def forward(ctx, gate, up, roundings, triton):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        dtype = gate.dtype
        if kernels.available(gate, triton) and dtype in (torch.bfloat16, torch.float16):
            return kernels.swiglu_forward(gate, up, roundings)  # same formula, one fused Triton pass
        with autocast_disabled(gate):
            a = F.silu(gate.float())
            if roundings == 2:
                # eager act_and_mul (HF act_fn(gate) * up; vLLM CUDA kernel): silu output stored in bf16.
                a = rnd(a, dtype)
            # the product is rounded once into the output buffer (every path); in place: no fp32 copy of
            # up (a bf16 operand is widened exactly inside the multiply)
            return a.mul_(up).to(dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        with autocast_disabled(grad):
            # same operations in the same order as go*g*sig and go*u*sig*(1 + g*(1 - sig)), but in place:
            # 3 fp32 [T, I] buffers live instead of ~9 (on CPU every fresh buffer also costs page faults)
            g, go = gate.float(), grad.to(torch.float32, copy=True)  # go is updated in place below
            sig = torch.sigmoid(g)
            d_up = torch.mul(go, g).mul_(sig).to(up.dtype)  # (go*g)*sig
            t = torch.rsub(sig, 1.0).mul_(g).add_(1.0)  # 1 + g*(1 - sig)
            del g
            d_gate = go.mul_(up).mul_(sig).mul_(t)  # ((go*u)*sig)*t
        return d_gate.to(gate.dtype), d_up, None, None


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, rounding: SwigluRounding, *, triton: bool = False
) -> torch.Tensor:
    """``R(silu(g) * u)`` (1 rounding) or ``R(R(silu(g)) * u)`` (2 roundings), in ``gate.dtype``.

    ``triton=True`` (``experimental.kernels=triton``) runs the forward as the opt-in Triton kernel on CUDA tensors.
    """
    return _SwigluFn.apply(gate, up, rounding.roundings, triton)
