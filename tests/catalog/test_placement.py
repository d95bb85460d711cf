"""Workers verify their profile against where the model runs (rlalign_verl.catalog.placement), table-driven."""

from __future__ import annotations

import re

import pytest
import torch

from rlalign_verl.base.errors import ProfileMismatchError
from rlalign_verl.catalog.placement import (
    check_placement,
    check_rollout,
    profile_for_device,
    worker_device_type,
)
from rlalign_verl.catalog.profiles import PROFILES

# (profile, device, auto, rollout) -> the profile used, or the fix the error must name
CASES = [
    ("vllm", "cuda", False, "vllm", "vllm"),
    ("vllm-eager", "cuda", False, "vllm", "vllm-eager"),
    ("sglang", "cuda", False, "sglang", "sglang"),
    ("vllm-cpu", "cpu", False, "vllm", "vllm-cpu"),
    ("vllm-cpu-eager", "cpu", False, "vllm", "vllm-cpu-eager"),
    ("hf", "cpu", False, None, "hf"),
    ("hf", "cuda", False, "", "hf"),
    # a CPU-only driver resolved auto: the GPU worker moves it to the same engine path on CUDA
    ("vllm-cpu", "cuda", True, "vllm", "vllm"),
    ("vllm-cpu-eager", "cuda", True, "vllm", "vllm-eager"),
    ("vllm", "cpu", True, "vllm", "vllm-cpu"),
    ("vllm-eager", "cpu", True, "vllm", "vllm-cpu-eager"),
    # explicit choices that contradict the device: errors naming the fix
    ("vllm", "cpu", False, "vllm", "error: alignment.engine=vllm-cpu (or auto)"),
    ("vllm-eager", "cpu", False, "vllm", "error: alignment.engine=vllm-cpu-eager (or auto)"),
    ("vllm-cpu", "cuda", False, "vllm", "error: alignment.engine=vllm (or auto)"),
    ("vllm-cpu-eager", "cuda", False, "vllm", "error: alignment.engine=vllm-eager (or auto)"),
    ("sglang", "cpu", False, "sglang", "error: alignment.engine=auto or a profile for this device"),
    ("sglang", "cpu", True, "sglang", "error: alignment.engine=auto or a profile for this device"),
    # hf aligns to nothing a real engine does
    ("hf", "cuda", False, "vllm", "error: use alignment.engine=auto (or a vllm profile)"),
    ("hf", "cuda", True, "sglang", "error: use alignment.engine=auto (or a sglang profile)"),
]


@pytest.mark.parametrize("profile, device, auto, rollout, want", CASES)
def test_profile_for_device(profile: str, device: str, auto: bool, rollout: str | None, want: str) -> None:
    if want.startswith("error: "):
        with pytest.raises(ProfileMismatchError, match=re.escape(want[7:]) + "$"):
            profile_for_device(profile, device, auto=auto, rollout=rollout)
    else:
        assert profile_for_device(profile, device, auto=auto, rollout=rollout).name == want


def test_every_profile_is_covered_on_both_devices() -> None:
    assert {(p, d) for p in PROFILES for d in ("cpu", "cuda")} <= {(p, d) for p, d, *_ in CASES}


def test_check_rollout_only_refuses_hf_with_a_real_engine() -> None:
    for name in PROFILES:
        for rollout in ("", None, "hf", "vllm", "sglang"):
            bad = name == "hf" and rollout in ("vllm", "sglang")
            if bad:
                with pytest.raises(ProfileMismatchError):
                    check_rollout(name, rollout)
            else:
                assert check_rollout(name, rollout).name == name


def test_worker_device_is_where_the_parameters_live() -> None:
    model = torch.nn.Linear(2, 2)
    assert worker_device_type(model) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert worker_device_type(None) == worker_device_type(object())
    if not torch.cuda.is_available():  # this CPU machine: an explicit CUDA profile fails in the worker
        with pytest.raises(ProfileMismatchError, match="CPU-only worker; use alignment.engine=vllm-cpu"):
            check_placement("vllm", model)
        assert check_placement("vllm", model, auto=True).name == "vllm-cpu"


@pytest.mark.parametrize(
    "cpus, ranks, want",
    [({0, 1}, 2, "0|1"), ({0, 1, 2, 3}, 2, "0,1|2,3"), ({3}, 2, "3|3"), ({0, 1, 2}, 2, "0|1")],
)
def test_cpu_rank_binding_splits_this_process_cpus(monkeypatch, cpus, ranks, want):
    """vLLM's CPU TP needs each rank bound to its own CPUs (VLLM_CPU_OMP_THREADS_BIND, ranks separated by |)."""
    import os

    from rlalign_verl.catalog.placement import cpu_rank_binding

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    assert cpu_rank_binding(ranks) == want


@pytest.mark.parametrize(
    "avx512, bf16, want", [(True, True, "nearest"), (True, False, "truncate"), (False, False, "nearest")]
)
def test_vllm_cpu_allreduce_store_follows_the_kernel_library(monkeypatch, avx512, bf16, want):
    """Source facts: vLLM loads _C (AVX512-BF16), _C_AVX512 or _C_AVX2 (vllm/platforms/cpu.py import_kernels); the
    shm all-reduce exists only under __AVX512F__ (csrc/cpu/torch_bindings.cpp; `strings _C_AVX2.abi3.so` has no
    shm_allreduce in vllm-cpu 0.31.0) and stores with BF16Vec16(FP32Vec16): cvtneps (nearest) with AVX512-BF16,
    truncation without; the AVX2 fallback is gloo's bf16 add (c10::BFloat16: fp32 add, round to nearest)."""
    import platform

    import torch

    from rlalign_verl.catalog.profiles_tp import vllm_cpu_allreduce_store

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert vllm_cpu_allreduce_store() == want
