"""One model-level setting: every variant timed interleaved on the same model, then its memory measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from overhead_model import Size, Variant, forward_only, make_inputs, set_mode, set_variant, step_fn
from peak_memory import param_bytes, peak_memory, sync

from rlalign_verl.align.patch import remove_alignment


@dataclass
class Result:
    """One variant in one setting: its timed rounds, medians, peak/held bytes and ratios to ``hf``."""

    size: str
    dtype: str
    layout: str
    mode: str
    variant: str
    profile: str | None
    regions: list[str]
    tokens: int
    times_ms: list[float] = field(default_factory=list)
    cpu_times_ms: list[float] = field(default_factory=list)
    median_ms: float = 0.0
    median_cpu_ms: float = 0.0
    time_ratio: float = 1.0
    wall_ratio: float = 1.0
    step_peak_bytes: int = 0
    step_peak_ratio: float = 1.0
    total_peak_bytes: int = 0
    total_peak_ratio: float = 1.0
    held_bytes: int = 0
    held_ratio: float = 1.0


def run_setting(
    model: torch.nn.Module,
    size: Size,
    dtype: str,
    layout: str,
    mode: str,
    variants: list[Variant],
    repeat: int,
    warmup: int,
    device: str,
) -> list[Result]:
    """Time (interleaved) and measure memory of every variant on one model, one input, one mode."""
    batch = make_inputs(size, layout, device)
    set_mode(model, mode)
    fn = step_fn(model, batch, mode, autocast=dtype == "fp32+autocast")
    tokens = int(batch["loss_mask"].sum())
    results = [
        Result(size.name, dtype, layout, mode, v.name, v.profile, list(v.regions), tokens) for v in variants
    ]
    _time_interleaved(model, fn, variants, results, repeat, warmup, device)
    _measure_memory(
        model, fn, lambda: forward_only(model, batch, dtype == "fp32+autocast"), variants, results, device
    )
    remove_alignment(model)
    _set_ratios(results, device)
    return results


def _time_interleaved(
    model: torch.nn.Module,
    fn: Callable[[], None],
    variants: list[Variant],
    results: list[Result],
    repeat: int,
    warmup: int,
    device: str,
) -> None:
    """One step of each variant per round, the order rotated every round; warm-up rounds are not recorded."""
    n = len(variants)
    for rnd in range(warmup + repeat):
        for j in range(n):
            i = (j + rnd) % n  # rotate the order every round
            set_variant(model, variants[i])
            sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            sync(device)
            if rnd >= warmup:
                results[i].times_ms.append((time.perf_counter() - t0) * 1e3)
                results[i].cpu_times_ms.append((time.thread_time() - c0) * 1e3)


def _measure_memory(
    model: torch.nn.Module,
    fn: Callable[[], None],
    forward: Callable[[], torch.Tensor],
    variants: list[Variant],
    results: list[Result],
    device: str,
) -> None:
    """Medians of the timed rounds, then per variant an untimed step's peak memory and the forward's held bytes."""
    weights = param_bytes(model)
    for v, r in zip(variants, results, strict=True):
        set_variant(model, v)
        # free the gradients before the profiler starts: it records the free of a block it saw allocated
        # (in an earlier profiled step) but not of one allocated before, which would skew the sum
        model.zero_grad(set_to_none=True)
        r.median_ms = statistics.median(r.times_ms)
        r.median_cpu_ms = statistics.median(r.cpu_times_ms)
        r.step_peak_bytes, _ = peak_memory(fn, device)
        # total = weights + the step's peak above them (gradients are freed before each step, as
        # zero_grad(set_to_none=True) does, so they are part of the step's peak)
        r.total_peak_bytes = weights + r.step_peak_bytes
        if r.mode != "logprob":  # what the forward keeps alive for backward (the graph + its output)
            _, r.held_bytes = peak_memory(forward, device)


def _set_ratios(results: list[Result], device: str) -> None:
    """Every result's time and memory relative to the first (``hf``)."""
    base = results[0]
    for r in results:
        r.wall_ratio = r.median_ms / base.median_ms
        # CPU: this thread's CPU time (one intra-op thread), which other processes on a shared machine
        # disturb far less than wall time; CUDA: wall time (the host thread waits in synchronize)
        r.time_ratio = r.median_cpu_ms / base.median_cpu_ms if device == "cpu" else r.wall_ratio
        r.step_peak_ratio = r.step_peak_bytes / max(base.step_peak_bytes, 1)
        r.total_peak_ratio = r.total_peak_bytes / max(base.total_peak_bytes, 1)
        r.held_ratio = r.held_bytes / base.held_bytes if base.held_bytes else 1.0
