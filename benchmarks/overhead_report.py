"""The benchmark's output: the machine it ran on and the model-level results table."""

from __future__ import annotations

import os
import platform

import torch
from overhead_setting import Result


def machine_info(device: str) -> dict[str, object]:
    """Versions, threads, CPU model (and GPU name on CUDA) recorded with the results."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def format_table(results: list[Result]) -> str:
    """The model-level table: header, rule, one row per result."""
    head = (
        f"{'size':<9} {'dtype':<13} {'layout':<6} {'mode':<8} {'variant':<16} {'wall ms':>9} {'wall x':>7} "
        f"{'cpu ms':>8} {'time x':>7} "
        f"{'step MiB':>9} {'step x':>7} {'total x':>7} {'held MiB':>9} {'held x':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        held = (
            f"{r.held_bytes / 2**20:9.1f} {r.held_ratio:7.3f}"
            if r.mode != "logprob"
            else f"{'-':>9} {'-':>7}"
        )
        lines.append(
            f"{r.size:<9} {r.dtype:<13} {r.layout:<6} {r.mode:<8} {r.variant:<16} {r.median_ms:9.1f} "
            f"{r.wall_ratio:7.3f} {r.median_cpu_ms:8.1f} {r.time_ratio:7.3f} {r.step_peak_bytes / 2**20:9.1f} {r.step_peak_ratio:7.3f} "
            f"{r.total_peak_ratio:7.3f} {held}"
        )
    return "\n".join(lines)
