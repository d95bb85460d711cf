"""Optional Triton forward kernels for the RoPE and SwiGLU regions (CUDA only).

Each kernel computes exactly the rounding formula of the PyTorch region function
(:mod:`rlalign_verl.align.regions`) in one pass, without the fp32 temporaries:

* :func:`swiglu_forward` - ``R(silu(g) * u)`` / ``R(R(silu(g)) * u)``;
* :func:`rope_forward` - ``R(x1*c - x2*s)`` / ``R(R(x1*c) - R(x2*s))`` and the second half.

They are **opt-in** (``apply_alignment(kernels="triton")``, ``alignment.experimental.kernels=triton`` in verl,
``--alignment.experimental.kernels triton`` in OpenRLHF; checked by :func:`rlalign_verl.request.checks.check_kernels`) and run only on CUDA tensors (:func:`available`): no recorded GPU
run has checked them yet, so the default CUDA path is the PyTorch fp32 region functions the CPU tests
exercise. The region functions stay the reference and own the backward. No RMSNorm kernel: the variance is a reduction, and no kernel reproduces the summation
order of ``torch.sum``, so it could not be bit-equal to the PyTorch path.

Bit-equality with the PyTorch path rests on: fp32 arithmetic without FMA contraction
(``enable_fp_fusion=False``), IEEE division (``div_rn``), the same ``exp`` as PyTorch's CUDA
``silu`` (libdevice ``expf``), and an explicit round-to-nearest-even to bf16 done on the bits (the
Triton CPU interpreter truncates on ``.to(bfloat16)``; on GPUs both agree).
"""

from __future__ import annotations

import importlib.util

import torch

from rlalign_verl.align.kernels.interpreter import interpreter_active
from rlalign_verl.request.spec import KERNELS

__all__ = ["KERNELS", "available", "interpreter_active", "rope_forward", "swiglu_forward"]


def available(t: torch.Tensor, requested: bool = False) -> bool:
    """True when the Triton path is used for ``t``: ``requested`` (the spec's ``experimental.kernels``),
    Triton installed and ``t`` on a CUDA device. Default: the PyTorch path.
    """
    if not (requested and t.is_cuda):
        return False
    return importlib.util.find_spec("triton") is not None


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, roundings: int) -> torch.Tensor:
    """SwiGLU forward in ``gate.dtype`` (bf16 or fp16); see :mod:`rlalign_verl.align.regions.swiglu`."""
    from rlalign_verl.align.kernels._triton import swiglu_forward as impl

    return impl(gate, up, roundings)


def rope_forward(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, roundings: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` with fp32 ``cos, sin`` ``[B, 1, T, D]`` (or ``[B, T, D]``).

    ``cos``/``sin`` are the values the rotation reads, already rounded when the profile's table is
    bf16 (as :func:`rlalign_verl.align.regions.rope.apply_rope` prepares them). Returns ``out_dtype``.
    """
    from rlalign_verl.align.kernels._triton import rope_forward as impl

    return impl(x, cos, sin, roundings, out_dtype)
