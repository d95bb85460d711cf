"""The OpenRLHF worker's placement check (``placed_profile``): the driver's profile against the worker's device.

Needs no OpenRLHF (runs in the main suite too): the check is plain data from ``rlalign_verl.catalog.placement``.
"""

from __future__ import annotations

import pytest

from rlalign_verl.base.errors import ProfileMismatchError
from rlalign_verl.openrlhf.settings import Settings
from rlalign_verl.openrlhf.setup import placed_profile

# id -> (profile from the launcher, --alignment.engine auto?, worker device, profile used | error fragment)
CASES = {
    "auto on a CPU-only worker": ("vllm", True, "cpu", "vllm-cpu"),
    "auto eager on a CPU-only worker": ("vllm-eager", True, "cpu", "vllm-cpu-eager"),
    "auto on a CUDA worker": ("vllm", True, "cuda", "vllm"),
    "auto eager on a CUDA worker": ("vllm-eager", True, "cuda", "vllm-eager"),
    "explicit CPU profile on a CPU worker": ("vllm-cpu", False, "cpu", "vllm-cpu"),
    "explicit CUDA profile on a CUDA worker": ("vllm", False, "cuda", "vllm"),
    "explicit CUDA profile on a CPU-only worker": (
        "vllm", False, "cpu", "runs on a CPU-only worker; use alignment.engine=vllm-cpu (or auto)"),
    "explicit eager CUDA profile on a CPU-only worker": (
        "vllm-eager", False, "cpu", "use alignment.engine=vllm-cpu-eager (or auto)"),
    "explicit CPU profile on a CUDA worker": (
        "vllm-cpu", False, "cuda", "vllm CPU build but this model runs on a CUDA worker; use alignment.engine=vllm (or auto)"),
    "explicit eager CPU profile on a CUDA worker": (
        "vllm-cpu-eager", False, "cuda", "use alignment.engine=vllm-eager (or auto)"),
    "sglang with OpenRLHF's vLLM rollout": (
        "sglang", True, "cpu", "is a sglang profile but the rollout engine is vllm"),
    "hf with OpenRLHF's vLLM rollout": ("hf", False, "cpu", "profile hf mirrors HF's own rounding, not the vllm rollout"),
    "hf even with auto": ("hf", True, "cuda", "use alignment.engine=auto (or a vllm profile)"),
}  # fmt: skip


@pytest.mark.parametrize(("profile", "auto", "device", "want"), CASES.values(), ids=CASES.keys())
def test_worker_checks_its_profile_against_its_device(profile, auto, device, want):
    settings = Settings.build(regions=("rope",), profile=profile, auto=auto)
    if want.startswith("vllm") and " " not in want:
        assert placed_profile(settings, device) == want
        return
    with pytest.raises(ProfileMismatchError) as err:
        placed_profile(settings, device)
    assert want in str(err.value) and "\n" not in str(err.value)
