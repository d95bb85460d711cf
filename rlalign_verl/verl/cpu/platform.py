"""A ``cpu`` platform for verl's ``PlatformRegistry`` and the device module it hands out.

verl asks its platform for a torch device module (``get_torch_device()``) and calls CUDA-style memory
and IPC functions on it every step (``verl/workers/engine_workers.py`` logs
``max_memory_allocated``/``max_memory_reserved``; ``bucketed_weight_transfer.py`` calls ``ipc_collect``;
``flops_counter.py`` asks ``get_device_name``). ``torch.cpu`` has none of them, so the module below wraps
``torch.cpu`` and answers them with real numbers for this process (resident memory from ``/proc`` via
``resource``/``psutil``), never with made-up zeros.
"""

from __future__ import annotations

import contextlib
import os
import platform as _py_platform
import resource
from types import ModuleType
from typing import Any


def _rss_bytes() -> int:
    """Resident set size of this process (what "allocated" means for a CPU device)."""
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is in KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class CPUDeviceModule(ModuleType):
    """``torch.cpu`` plus the memory/IPC queries verl makes on a CUDA device module."""

    def __init__(self) -> None:
        super().__init__("rlalign_verl_cpu_device")
        import torch

        self._torch_cpu = torch.cpu

    def __getattr__(self, name: str) -> Any:  # everything torch.cpu has (synchronize, Stream, ...)
        return getattr(self.__dict__["_torch_cpu"], name)

    def get_device_name(self, device: Any = None) -> str:
        """The CPU model string (verl matches it against its peak-FLOPS table; CPUs get none)."""
        return f"CPU {_py_platform.processor() or _py_platform.machine()}"

    def memory_allocated(self, device: Any = None) -> int:
        return _rss_bytes()

    def memory_reserved(self, device: Any = None) -> int:
        return _rss_bytes()

    def max_memory_allocated(self, device: Any = None) -> int:
        return _peak_rss_bytes()

    def max_memory_reserved(self, device: Any = None) -> int:
        return _peak_rss_bytes()

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """No-op: the kernel's peak RSS cannot be reset, so max_* report the process-lifetime peak."""

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """``(free, total)`` bytes of host memory, as ``torch.cuda.mem_get_info`` reports for a GPU."""
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def ipc_collect(self) -> None:
        """No-op: no CUDA IPC handles exist on CPU (weight sync goes through shared memory)."""

    def empty_cache(self) -> None:
        """No-op: the CPU allocator has no cache to release."""


def make_platform_class(base: type) -> type:
    """The ``cpu`` platform class, derived from verl's ``PlatformBase`` (passed in: verl imports late)."""
    import torch

    device_module = CPUDeviceModule()

    class CPUPlatform(base):  # type: ignore[misc, valid-type]
        """verl platform for a CPU-only machine: gloo, a fake ``GPU`` Ray resource, no IPC."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            pass

        def synchronize(self, device_index: Any = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            # verl's resource pools ask Ray for accelerators under this name: the recipe starts Ray
            # with ray_init.num_gpus=1 so one placement group {GPU: 1, CPU: k} fits.
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False  # verl then syncs weights through shared memory (vllm_rollout.py use_shm)

        def cudart(self) -> None:
            return None

    return CPUPlatform
