"""Does the engine profile fit where the model runs? Checked in every worker that aligns a model.

A profile mirrors one engine build: ``vllm``/``vllm-eager``/``sglang`` are the CUDA kernels and
compiled graphs, ``vllm-cpu``/``vllm-cpu-eager`` the CPU build, ``hf`` HF's own rounding (no engine).
The driver may resolve ``alignment.engine=auto`` on a machine without the workers' devices (a CPU-only
Ray head node with GPU workers), so the worker settles it where the model lives:

* an ``auto`` choice is moved to the same engine path on the worker's device (``vllm-cpu`` -> ``vllm``);
* an explicit choice that contradicts the device is an error naming the fix;
* ``hf`` with a real vLLM/SGLang rollout is an error (it aligns to nothing the rollout does).

The rules are data (:data:`DEVICE_COUNTERPART`, :data:`ROLLOUT_ENGINES`); :func:`check_placement` applies them.
"""

from __future__ import annotations

import os
from typing import Any

from rlalign_verl.base.errors import ProfileMismatchError
from rlalign_verl.catalog.profiles import EngineProfile, get_profile

DEVICE_COUNTERPART: dict[tuple[str, str], str] = {
    ("vllm-cpu", "cuda"): "vllm",
    ("vllm-cpu-eager", "cuda"): "vllm-eager",
    ("vllm", "cpu"): "vllm-cpu",
    ("vllm-eager", "cpu"): "vllm-cpu-eager",
}
"""``(profile, device)`` -> the profile of the same engine path built for ``device``."""

ROLLOUT_ENGINES: tuple[str, ...] = ("vllm", "sglang")
"""Rollout names of real inference engines (an ``hf`` profile aligns to none of them)."""


def vllm_cpu_kernel_store() -> str:
    """How vLLM's CPU C++ kernels store fp32 results in bf16 on this host: ``"nearest"`` or ``"truncate"``.

    vllm/platforms/cpu.py ``import_kernels`` loads ``_C`` (built with AVX512-BF16: ``cvtneps`` rounds to
    nearest) only where ``torch.cpu._is_avx512_bf16_supported()``; elsewhere ``_C_AVX512`` / ``_C_AVX2``,
    whose ``BF16Vec`` conversion drops the low 16 bits (csrc/cpu/cpu_types_x86.hpp). Measured on an AVX2
    host: ``rotary_embedding`` and ``silu_and_mul`` 100% equal to truncation, 50% to nearest.
    """
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ProfileMismatchError(
            f"vLLM's CPU kernel rounding is verified on x86_64 only, not {platform.machine()}; "
            "use alignment.engine=vllm-cpu (compiled: no C++ kernel in the aligned regions)"
        )
    return "nearest" if torch.cpu._is_avx512_bf16_supported() else "truncate"


def worker_device_type(module: Any = None) -> str:
    """``"cuda"`` or ``"cpu"``: where this worker's model runs (its parameters, else the visible devices)."""
    import torch

    params = getattr(module, "parameters", None)
    if callable(params):
        for p in params():
            if p.device.type == "cuda":
                return "cuda"
            break
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_rollout(profile: str | EngineProfile, rollout: str | None) -> EngineProfile:
    """Raise if ``profile`` is ``hf`` while a real engine (``rollout``) samples the rollouts."""
    prof = get_profile(profile)
    roll = str(rollout or "").strip().lower()
    if prof.engine == "hf" and roll in ROLLOUT_ENGINES:
        raise ProfileMismatchError(
            f"profile hf mirrors HF's own rounding, not the {roll} rollout engine, so aligning to it changes "
            f"nothing; use alignment.engine=auto (or a {roll} profile)"
        )
    return prof


def profile_for_device(
    profile: str | EngineProfile, device_type: str, *, auto: bool = False, rollout: str | None = None
) -> EngineProfile:
    """The profile to use on ``device_type``; raises :class:`ProfileMismatchError` (naming the fix) if wrong.

    ``auto``: the profile came from ``alignment.engine=auto`` on the driver and may be moved to its
    counterpart for this device. ``rollout``: the run's rollout engine name, if any.
    """
    prof = check_rollout(profile, rollout)
    if prof.device in ("any", device_type):
        return prof
    other = DEVICE_COUNTERPART.get((prof.name, device_type))
    if auto and other is not None:
        return get_profile(other)
    fix = (
        f"alignment.engine={other} (or auto)"
        if other
        else "alignment.engine=auto or a profile for this device"
    )
    where = "a CPU-only worker" if device_type == "cpu" else f"a {device_type.upper()} worker"
    raise ProfileMismatchError(
        f"profile {prof.name} mirrors the {prof.engine} {prof.device.upper()} build but this model runs on {where}; "
        f"use {fix}"
    )


def check_placement(
    profile: str | EngineProfile, module: Any = None, *, auto: bool = False, rollout: str | None = None
) -> EngineProfile:
    """:func:`profile_for_device` for the device ``module`` runs on in this worker."""
    return profile_for_device(profile, worker_device_type(module), auto=auto, rollout=rollout)


def cpu_rank_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` vLLM CPU ranks on this machine: the CPUs this process may use,
    split evenly (``0|1`` on 2 cores, ``0,1|2,3`` on 4); fewer CPUs than ranks are shared round-robin."""
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    per = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(ranks))
