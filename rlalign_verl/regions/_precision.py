"""Small helpers shared by the region functions: local autocast control and the rounding primitive."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def autocast_disabled(*tensors: torch.Tensor) -> Iterator[None]:
    """Disable autocast for the region's own math so fp32 intermediates stay fp32.

    Thread-local and scoped to the ``with`` block: no global torch state is changed.
    """
    device_type = tensors[0].device.type if tensors else "cpu"
    if not torch.amp.is_autocast_available(device_type):  # e.g. meta (shape tracing): no autocast to turn off
        yield
        return
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``R(x)``: round an fp32 tensor to the activation dtype, returned as fp32 for further math."""
    return x.to(dtype).float()


def truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    """``T(x)``: an fp32 tensor with its low 16 bits cleared, i.e. rounded toward zero to bf16, kept fp32.

    Its cast to bf16 is then exact. vLLM's CPU C++ kernels store bf16 this way where they are built
    without AVX512-BF16 (``csrc/cpu/cpu_types_x86.hpp``).
    """
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
