"""Peak bytes torch allocates during a step (CPU: the profiler's allocator records; CUDA: the allocator's stats)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def sync(device: str) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory(fn: Callable[[], object], device: str) -> tuple[int, int]:
    """(peak bytes torch allocates during ``fn`` above those allocated before it, bytes still held by
    what ``fn`` returns once it has returned)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        del out
        return torch.cuda.max_memory_allocated() - base, held
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in records:
        if e.device_type() == torch._C._autograd.DeviceType.CPU:
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak, cur


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
