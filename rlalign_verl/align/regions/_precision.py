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
    x = x.float()
    kept = (x.detach().contiguous().view(torch.int32) & -65536).view(torch.float32)
    # the dropped bits are exactly kept - x, so this is T(x) exactly; its gradient passes straight through,
    # as a cast's does
    return x + (kept - x.detach())


def host_store(store: str) -> str:
    """``"nearest"`` or ``"truncate"``: a profile's bf16 store, resolved for this host where it names vLLM's CPU kernels."""
    if store == "vllm-cpu-kernel":
        from rlalign_verl.catalog.placement import vllm_cpu_kernel_store

        return vllm_cpu_kernel_store()
    return store


def store_as(x: torch.Tensor, store: str, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 result stored in ``dtype`` the way ``store`` says (``R`` or, for bf16, ``T``)."""
    if dtype == torch.bfloat16 and host_store(store) == "truncate":
        return truncate_bf16(x).to(dtype)  # exact: the kept bits are a bf16 value
    return x.to(dtype)
