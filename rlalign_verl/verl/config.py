"""Driver side of the verl integration: the ``alignment`` node -> one resolved :class:`AlignmentSpec`.

Runs on the driver before Ray starts (from :mod:`rlalign_verl.main_ppo`, and from verl's own
``validate_config`` once the plugin has wrapped it), so bad settings fail before any GPU is touched. The
resolved spec (``engine=auto`` settled, the rollout engine recorded) is written once, as JSON, to
``actor_rollout_ref.model.override_config.rlalign_spec``: the actor's and ref's workers read only that.
"""

from __future__ import annotations

import os
from typing import Any

from rlalign_verl.base.errors import AlignmentError, ProfileMismatchError
from rlalign_verl.base.options import option_bool
from rlalign_verl.catalog.vllm_paths import REGION_OPS, kernels_on
from rlalign_verl.request.checkpoint import checkpoint_config
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import AlignmentSpec, refuse_resolved_keys
from rlalign_verl.verl.checks import check_alignment_node
from rlalign_verl.verl.compilation import compile_disabled, custom_ops_of
from rlalign_verl.verl.config_access import select
from rlalign_verl.verl.engine_facts import workers_device, workers_profile
from rlalign_verl.verl.log import logger
from rlalign_verl.verl.transport import OVERRIDE_PATH, SPEC_KEY

EP_KEY = "actor_rollout_ref.rollout.expert_parallel_size"
TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


PD_KEY = "actor_rollout_ref.rollout.disaggregation.enabled"
DECODE_TP_KEY = "actor_rollout_ref.rollout.disaggregation.decode_tensor_model_parallel_size"


def _size(key: str, value: Any) -> int:
    if isinstance(value, bool) or not str(value).strip().isdigit() or int(str(value).strip()) < 1:
        raise AlignmentError(f"{key}={value!r}: give the rollout's tensor-parallel size, an integer >= 1")
    return int(str(value).strip())


def rollout_tp_of(config: Any, regions: tuple[str, ...] = ()) -> int:
    """The rollout's tensor-parallel size (verl's composed config always carries it: 2 in verl 0.9.1's rollout
    defaults; 1 when absent); a value that is no integer >= 1 is refused.

    With SGLang's prefill-decode disaggregation (``rollout.disaggregation.enabled``) the decode servers may run
    another TP size (``decode_tensor_model_parallel_size``): every response token but the first is decoded
    there, so that size is the rollout's; the ``tp`` region models one size and refuses two.
    """
    value = select(config, TP_KEY, 1)
    tp = _size(TP_KEY, 1 if value is None else value)
    decode = select(config, DECODE_TP_KEY)
    enabled = option_bool(select(config, PD_KEY), name=PD_KEY, default=False)
    if decode is None or not enabled:
        return tp
    decode = _size(DECODE_TP_KEY, decode)
    if decode != tp and "tp" in regions:
        raise AlignmentError(
            f"alignment.regions has tp but the rollout prefills at {TP_KEY}={tp} and decodes at {DECODE_TP_KEY}="
            f"{decode}: the tp region models one all-reduce size; set {DECODE_TP_KEY}=null (or {tp}), or drop tp"
        )
    return decode


FSDP_STRATEGIES = ("fsdp", "fsdp2")
PLUGIN_NAME = "rlalign_verl"
"""Our entry point's name in the ``verl.plugins`` group (what ``VERL_USE_EXTERNAL_PLUGINS`` lists)."""


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (imports torch lazily)."""
    import torch

    return bool(torch.cuda.is_available())


def choose_profile(
    rollout_name: str | None,
    *,
    enforce_eager: bool = False,
    compilation_config: Any = None,
    on_cuda: bool = True,
) -> tuple[str, str]:
    """The engine profile matching verl's rollout settings, and why (for ``alignment.engine=auto``)."""
    name = (rollout_name or "").strip().lower()
    if not name:
        raise ProfileMismatchError(
            "alignment.engine=auto needs actor_rollout_ref.rollout.name (vllm or sglang) to choose a profile; "
            "set actor_rollout_ref.rollout.name or alignment.engine explicitly"
        )
    if name == "sglang":
        return "sglang", "rollout.name=sglang (SGLang's CUDA kernels)"
    if name != "vllm":
        raise ProfileMismatchError(
            f"no engine profile for rollout.name={name!r}; set alignment.engine to one of "
            f"vllm, vllm-eager, vllm-cpu, vllm-cpu-eager, sglang, hf, or turn alignment off with alignment.regions=[]"
        )
    device = "cuda" if on_cuda else "cpu"
    suffix = "" if on_cuda else "-cpu"
    if enforce_eager:
        return f"vllm{suffix}-eager", f"rollout.name=vllm, rollout.enforce_eager=True, device {device}"
    if compile_disabled(compilation_config):
        return (
            f"vllm{suffix}-eager",
            f"rollout.name=vllm, compilation mode 0 in engine_kwargs.vllm.compilation_config (custom ops run "
            f"their kernels), device {device}",
        )
    ops = custom_ops_of(compilation_config)
    kernels = kernels_on(ops)
    if kernels is None:
        raise ProfileMismatchError(
            f"engine_kwargs.vllm.compilation_config.custom_ops={ops} turns on only some of {list(REGION_OPS)}: "
            f"no single profile matches that mix; set alignment.engine explicitly (e.g. vllm or vllm-eager)"
        )
    if kernels:
        return (
            f"vllm{suffix}-eager",
            f"rollout.name=vllm, custom_ops={ops} runs the region kernels as in eager mode, device {device}",
        )
    return (
        f"vllm{suffix}",
        f"rollout.name=vllm, enforce_eager=False (compiled graph, custom ops off), device {device}",
    )


def read_spec(config: Any) -> AlignmentSpec | None:
    """The ``alignment`` node parsed (unresolved), or ``None`` for a plain verl run without our group."""
    node = select(config, "alignment")
    check_alignment_node(node)
    if node is None:
        return None
    refuse_resolved_keys(node, "hydra")
    return AlignmentSpec.parse(node, spelling="hydra")


def resolve_spec(
    config: Any, spec: AlignmentSpec, *, on_cuda: bool | None = None
) -> tuple[AlignmentSpec, str]:
    """``spec`` with ``engine=auto`` settled from the rollout settings and the rollout engine recorded; why."""
    rollout = str(select(config, "actor_rollout_ref.rollout.name") or "").strip().lower()
    # the rollout's TP size is a fact of the rollout, like compiled/eager
    spec = spec.replace(rollout_tp=rollout_tp_of(config, spec.regions))
    if spec.engine != "auto":
        return spec.replace(rollout=rollout), f"alignment.engine={spec.engine} (set explicitly)"
    if on_cuda is None:
        on_cuda = cuda_available()
    eager_key = "actor_rollout_ref.rollout.enforce_eager"
    name, reason = choose_profile(
        rollout,
        enforce_eager=option_bool(select(config, eager_key), name=eager_key, default=False),
        compilation_config=select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"),
        on_cuda=on_cuda,
    )
    return spec.replace(engine=name, engine_auto=True, rollout=rollout), f"alignment.engine=auto: {reason}"


def would_use_profile(config: Any, *, on_cuda: bool | None = None) -> str:
    """The profile the workers would use if regions were on (for a baseline run's start-up line); never raises."""
    try:
        spec = read_spec(config) or AlignmentSpec()
        return resolve_spec(config, spec, on_cuda=on_cuda)[0].engine
    except AlignmentError as err:
        return f"auto (unresolved: {err})"


def _actor_config_path(config: Any) -> Any:
    """Where the driver reads the actor's HF config: ``hf_config_path``, else the checkpoint ``path``."""
    return select(config, "actor_rollout_ref.model.hf_config_path") or select(
        config, "actor_rollout_ref.model.path"
    )


def model_of(config: Any) -> tuple[str | None, Any]:
    """``(model_type, config.json as attributes)`` of the actor checkpoint, read on the driver before Ray starts
    (:func:`~rlalign_verl.request.checkpoint.checkpoint_config`; the config is ``None`` for a hub id)."""
    from types import SimpleNamespace

    hf_config = select(config, "actor_rollout_ref.model.hf_config_path")
    key = "actor_rollout_ref.model.hf_config_path" if hf_config else "actor_rollout_ref.model.path"
    fix = (
        "set it to the checkpoint's config.json (or the folder holding it) as the driver sees it"
        if hf_config
        else "verl's default path is a placeholder: set it to the checkpoint folder the workers load (a path only the "
        "worker nodes see: also set actor_rollout_ref.model.hf_config_path to a copy of its config.json the driver "
        "can read)"
    )
    name = "actor_rollout_ref.model.trust_remote_code"
    model_type, data = checkpoint_config(
        _actor_config_path(config),
        key,
        missing_fix=fix,
        trust_remote_code=option_bool(select(config, name), name=name, default=False),
        sep="=",
        file_ok=bool(hf_config),  # transformers' AutoConfig reads a config file given directly
        log=logger,
        machine="the driver",
    )
    return model_type, (None if data is None else SimpleNamespace(**data))


def check_plugin_reaches_workers() -> None:
    """Raise if verl would not load our plugin in its processes (the workers would run unaligned)."""
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    allowed = {name.strip() for name in policy.split(",") if name.strip()}
    if policy == "none" or (policy != "auto" and PLUGIN_NAME not in allowed):
        raise AlignmentError(
            f"VERL_USE_EXTERNAL_PLUGINS={policy} keeps verl from loading the {PLUGIN_NAME} plugin, so the workers "
            f"would train unaligned; unset it or add {PLUGIN_NAME} to the list, or set alignment.regions=[]"
        )
    from importlib.metadata import entry_points

    if not any(ep.name == PLUGIN_NAME for ep in entry_points(group="verl.plugins")):
        raise AlignmentError(
            f"no '{PLUGIN_NAME}' entry point in the verl.plugins group: rlalign-verl is importable but not installed "
            f"as a package, so verl's workers would not load the plugin; install it (pip install -e . or "
            f"pip install rlalign-verl) or set alignment.regions=[]"
        )


def _check_verl_run(config: Any) -> None:
    """What an aligned verl run needs beyond the spec: FSDP workers that load the plugin and have its hook."""
    for role in ("actor", "ref"):
        strategy = select(config, f"actor_rollout_ref.{role}.strategy")
        if strategy is not None and str(strategy) not in FSDP_STRATEGIES:
            raise AlignmentError(
                f"actor_rollout_ref.{role}.strategy={strategy}: rlalign-verl patches models built by verl's FSDP "
                f"engine only; use strategy fsdp or fsdp2, or alignment.regions=[]"
            )
    check_plugin_reaches_workers()
    from rlalign_verl.verl.model_hook import check_hook_target

    check_hook_target()


def write_worker_spec(config: Any, spec: AlignmentSpec | None) -> None:
    """Put the resolved spec where the actor and ref workers read it (one ``override_config`` key)."""
    from omegaconf import DictConfig, OmegaConf, open_dict

    if not isinstance(config, DictConfig) or spec is None:
        return  # plain verl run without our config group: touch nothing
    node = OmegaConf.select(config, OVERRIDE_PATH, throw_on_missing=False)
    if node is None:
        with open_dict(config):
            OmegaConf.update(config, OVERRIDE_PATH, {}, force_add=True)
        node = OmegaConf.select(config, OVERRIDE_PATH)
    with open_dict(node):
        # regions=[] is written too: it overrides a stale value in the checkpoint's config.json
        node[SPEC_KEY] = spec.to_json()


LOGPROBS_KEY = "actor_rollout_ref.rollout.calculate_log_probs"


def check_metrics_config(config: Any, spec: AlignmentSpec | None) -> None:
    """Raise when metrics or verification are on but the rollout returns no log-probs to compare with."""
    if spec is None or not (spec.metrics or (spec.regions and spec.verify.enable)):
        return
    if not option_bool(select(config, LOGPROBS_KEY), name=LOGPROBS_KEY, default=False):
        what = "alignment.metrics=true" if spec.metrics else "alignment.verify.enable=true"
        raise AlignmentError(
            f"{what} needs the rollout log-probs: set {LOGPROBS_KEY}=True (or alignment.metrics=false and "
            "alignment.verify.enable=false)"
        )


_validated: dict[int, tuple[Any, AlignmentSpec | None]] = {}


def _workers_device(config: Any, on_cuda: bool) -> str | None:
    """``cpu`` for CPU workers (trainer.device=cpu or the CPU adaptations), ``cuda`` on a GPU driver, else unknown
    (a CPU driver: ``auto`` resolves to the CPU build here and each worker moves it to its device's build)."""
    if workers_device(config) == "cpu":  # another accelerator (npu) is refused there
        return "cpu"
    return "cuda" if on_cuda else None


def validate_config(config: Any, *, on_cuda: bool | None = None) -> AlignmentSpec | None:
    """Check the alignment request against the rest of the verl config; raise one line naming the fix.

    Writes the resolved spec into ``actor_rollout_ref.model.override_config`` (the workers never see
    ``auto``), checks the metrics and verification settings, and returns the spec (``None``: no ``alignment``
    group, a plain verl run).
    """
    done = _validated.get(id(config))
    if done is not None and done[0] is config:
        return done[1]
    spec = read_spec(config)
    if spec is None:
        _validated[id(config)] = (config, None)
        return None
    if on_cuda is None:
        on_cuda = cuda_available()
    reason = ""
    if spec.regions:
        device = _workers_device(config, on_cuda)
        spec, reason = resolve_spec(config, spec, on_cuda=on_cuda and device != "cpu")
        _check_verl_run(config)
        liger_key = "actor_rollout_ref.model.use_liger"
        model_type, local = model_of(config)  # the checks that read the architecture run here, before Ray
        validate_request(
            spec,
            model_type=model_type,
            model_config=local,
            rollout=spec.rollout,
            # where the workers run, when the config or the driver says so: a profile built for the other device
            # is refused here, not after Ray starts (a CPU driver of a GPU cluster leaves it open)
            device=device,
            liger=option_bool(select(config, liger_key), name=liger_key, default=False),
            expert_parallel=select(config, EP_KEY, 1),
        )
        if not on_cuda and spec.profile().device == "cuda":
            logger.warning(
                "profile %s is a CUDA profile but the driver sees no CUDA device (fine if the workers have GPUs)",
                spec.engine,
            )
    else:
        validate_request(spec)  # alignment off: a setting that acts only on aligned regions is refused
    from rlalign_verl.verl.head_dtype import reconcile_head_dtype

    reconcile_head_dtype(config, spec)
    check_metrics_config(config, spec)
    if spec.doctor.enable:  # confounders that make the gap something other than rounding; errors stop here
        from rlalign_verl.request.regions import startup_lines
        from rlalign_verl.verl.doctor_config import check as doctor_check

        for line in doctor_check(config, allow=spec.doctor.allow) + startup_lines(spec):
            logger.warning("doctor: %s", line)
    write_worker_spec(config, spec)
    if spec.regions:
        logger.info(
            "alignment regions=%s profile=%s (%s); actor and ref are patched, critic untouched",
            ",".join(spec.regions),
            workers_profile(config, spec),
            reason,
        )
        from rlalign_verl.verl.engine_facts import say_unverified_engine

        say_unverified_engine(config, spec)
    else:
        logger.info(
            "alignment.regions is empty: alignment off (profile would be %s)", would_use_profile(config)
        )
    _validated[id(config)] = (config, spec)
    return spec
