"""Driver-side handling of the ``alignment`` config group: profile choice and validation.

Runs on the driver before Ray starts (from :mod:`rlalign_verl.main_ppo`, and from verl's own
``validate_config`` once the plugin has wrapped it), so bad settings fail before any GPU is touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import AlignmentError, ProfileMismatchError, UnknownProfileError
from ..options import option_bool
from ..profiles import get_profile
from ..regions import normalize_regions
from .checks import (
    EP_KEY,
    check_alignment_keys,
    check_alignment_node,
    check_expert_parallel,
    check_kernels,
    local_config_json,
    read_config_json,
)
from .compilation import REGION_OPS, compile_disabled, custom_ops_of, kernels_on, plain
from .log import logger

REGIONS_KEY = "rlalign_regions"
"""Attribute set on the actor's and ref's HF config (via ``model.override_config``)."""
ENGINE_KEY = "rlalign_engine"
"""Attribute holding the engine profile name, next to :data:`REGIONS_KEY`."""
COMPILE_KEY = "rlalign_compile"
"""Attribute set (only when true) for ``alignment.compile``: compiled SwiGLU/RoPE in the workers."""
AUTO_KEY = "rlalign_engine_auto"
"""Attribute set when the profile came from ``alignment.engine=auto``: the worker may move it to its device."""
ROLLOUT_KEY = "rlalign_rollout"
"""Attribute holding ``actor_rollout_ref.rollout.name`` for the worker's placement check."""
KERNELS_KEY = "rlalign_kernels"
"""Attribute set (only for ``alignment.kernels=triton``): the opt-in Triton SwiGLU/RoPE forwards."""
OVERRIDE_PATH = "actor_rollout_ref.model.override_config"
FSDP_STRATEGIES = ("fsdp", "fsdp2")


def _select(config: Any, key: str, default: Any = None) -> Any:
    """``OmegaConf.select`` that also accepts plain dicts and treats ``???`` as missing."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.select(config, key, default=default, throw_on_missing=False)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra/verl
        pass
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return default if node == "???" else node


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
    device = "cuda" if on_cuda else "cpu (no CUDA on the driver)"
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


def resolve_alignment_config(
    config: Any, *, on_cuda: bool | None = None
) -> tuple[tuple[str, ...], str | None, str]:
    """``(regions, profile_name, reason)`` from a composed verl config with our ``alignment`` group.

    ``profile_name`` is None when alignment is off. Raises for unknown regions or engines and for a
    profile that contradicts ``actor_rollout_ref.rollout.name``.
    """
    alignment = _select(config, "alignment")
    check_alignment_node(alignment)
    if alignment is not None:
        check_alignment_keys(alignment)
    if alignment is None:
        return (), None, "no alignment config (add +alignment=default): alignment off"
    regions = normalize_regions(plain(_select(config, "alignment.regions")))
    if not regions:
        would = would_use_profile(config, on_cuda=on_cuda)
        return (), None, f"alignment.regions is empty: alignment off (profile would be {would})"
    name, reason = _resolve_profile(config, on_cuda=on_cuda)
    return regions, name, reason


def _resolve_profile(config: Any, *, on_cuda: bool | None = None) -> tuple[str, str]:
    """``(profile_name, reason)`` for ``alignment.engine`` (``auto``: from the rollout settings)."""
    engine = str(_select(config, "alignment.engine", "auto") or "auto").strip().lower()
    rollout_name = _select(config, "actor_rollout_ref.rollout.name")
    if engine == "auto":
        if on_cuda is None:
            on_cuda = cuda_available()
        name, reason = choose_profile(
            rollout_name,
            enforce_eager=option_bool(
                _select(config, "actor_rollout_ref.rollout.enforce_eager"),
                name="actor_rollout_ref.rollout.enforce_eager",
                default=False,
            ),
            compilation_config=_select(
                config, "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"
            ),
            on_cuda=on_cuda,
        )
        return get_profile(name).name, f"alignment.engine=auto: {reason}"
    try:
        profile = get_profile(engine)
    except UnknownProfileError as err:
        raise UnknownProfileError(
            f"{err} (alignment.engine={engine!r}; or use alignment.engine=auto)"
        ) from None
    rollout = str(rollout_name or "").strip().lower()
    if profile.engine in ("vllm", "sglang") and rollout and rollout != profile.engine:
        raise ProfileMismatchError(
            f"alignment.engine={profile.name} is a {profile.engine} profile but actor_rollout_ref.rollout.name="
            f"{rollout}; use alignment.engine=auto (or a {rollout} profile) or change rollout.name"
        )
    return profile.name, f"alignment.engine={profile.name} (set explicitly)"


def would_use_profile(config: Any, *, on_cuda: bool | None = None) -> str:
    """The profile the workers would use if regions were on (for a baseline run's start-up line).

    Never raises: an unresolvable setting gives ``"auto (unresolved: <why>)"``.
    """
    try:
        return _resolve_profile(config, on_cuda=on_cuda)[0]
    except AlignmentError as err:
        return f"auto (unresolved: {err})"


def _model_type(config: Any) -> str | None:
    """``model_type`` of the actor's HF config (config.json read directly; AutoConfig for hub ids)."""
    path = _select(config, "actor_rollout_ref.model.hf_config_path") or _select(
        config, "actor_rollout_ref.model.path"
    )
    if not path:
        return None
    cfg_file = local_config_json(path)
    if cfg_file is not None:
        model_type = read_config_json(cfg_file).get("model_type")
        return None if model_type is None else str(model_type)
    name = "actor_rollout_ref.model.trust_remote_code"
    trust = option_bool(_select(config, name), name=name, default=False)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust).model_type
    except Exception as err:  # the worker checks again (apply_alignment raises there)
        logger.warning(
            "cannot read the model config at %s on the driver (%s); the model type is checked "
            "when the worker builds the model",
            path,
            err,
        )
        return None


PLUGIN_NAME = "rlalign_verl"
"""Our entry point's name in the ``verl.plugins`` group (what ``VERL_USE_EXTERNAL_PLUGINS`` lists)."""


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


def _check_metrics(config: Any) -> None:
    from .trainer_callback import check_metrics_config

    check_metrics_config(config)


def _write_worker_settings(
    config: Any, regions: tuple[str, ...], profile: str | None, compile_: bool
) -> None:
    """Put the resolved settings where the actor and ref workers read them (HF config attributes)."""
    from omegaconf import DictConfig, OmegaConf, open_dict

    if not isinstance(config, DictConfig):
        return
    if _select(config, "alignment") is None:
        return  # plain verl run without our config group: touch nothing
    node = OmegaConf.select(config, OVERRIDE_PATH, throw_on_missing=False)
    if node is None:
        with open_dict(config):
            OmegaConf.update(config, OVERRIDE_PATH, {}, force_add=True)
        node = OmegaConf.select(config, OVERRIDE_PATH)
    with open_dict(node):
        node[REGIONS_KEY] = list(regions)
        if regions:
            node[ENGINE_KEY] = profile
        else:  # alignment off: an explicit [] also overrides a stale value in the checkpoint's config.json
            node.pop(ENGINE_KEY, None)
        if regions and compile_:
            node[COMPILE_KEY] = True
        else:
            node.pop(COMPILE_KEY, None)
        if regions and _kernels(config) == "triton":
            node[KERNELS_KEY] = "triton"
        else:
            node.pop(KERNELS_KEY, None)
        _write_placement(config, node, regions)


def _write_placement(config: Any, node: Any, regions: tuple[str, ...]) -> None:
    """What the worker's placement check needs: whether the profile was ``auto`` and the rollout engine."""
    auto = str(_select(config, "alignment.engine", "auto") or "auto").strip().lower() == "auto"
    rollout = str(_select(config, "actor_rollout_ref.rollout.name") or "").strip().lower()
    for key, value in ((AUTO_KEY, bool(regions and auto)), (ROLLOUT_KEY, rollout if regions else "")):
        if value:
            node[key] = value
        else:
            node.pop(key, None)


def _kernels(config: Any) -> str:
    """``alignment.kernels`` checked on the driver (``torch`` default; ``triton`` opt-in)."""
    return check_kernels(_select(config, "alignment.kernels", "torch"), _select(config, "alignment.compile"))


_validated: dict[int, tuple[Any, tuple[tuple[str, ...], str | None]]] = {}


def _unverified(config: Any) -> tuple[str, ...]:
    """``alignment.unverified`` checked on the driver, joined with a ``RLALIGN_UNVERIFIED`` set here."""
    from ..unverified import resolve_unverified

    return resolve_unverified(plain(_select(config, "alignment.unverified")), name="alignment.unverified")


def _check_opt_in_regions(config: Any, regions: tuple[str, ...], profile: str | None) -> None:
    """attention: a profile whose attention can be reproduced; lm_head: one head dtype on both sides."""
    from .head_dtype import reconcile_head_dtype, write_worker_options

    if "attention" in regions:
        from ..regions.attention import check_attention_supported

        check_attention_supported(
            get_profile(profile), str(_select(config, "alignment.attention", "engine-op"))
        )
    if _select(config, "alignment.compiled_norm"):
        from ..options import parse_bool
        from ..regions.inductor_norm import check_compiled_norm

        on = parse_bool(_select(config, "alignment.compiled_norm"), name="alignment.compiled_norm")
        check_compiled_norm(get_profile(profile), regions, on)
    if regions:
        from ..moe_variant import check_moe_variant

        check_moe_variant(get_profile(profile), regions, _select(config, "alignment.moe_variant"))
    write_worker_options(config, regions, reconcile_head_dtype(config, regions), _unverified(config))


def validate_config(config: Any, *, on_cuda: bool | None = None) -> tuple[tuple[str, ...], str | None]:
    """Check the alignment settings against the rest of the verl config; raise a clear error if wrong.

    Also writes the resolved regions and profile into ``actor_rollout_ref.model.override_config`` (so
    the workers never see ``auto``) and checks the metrics settings. Returns ``(regions, profile)``.
    """
    done = _validated.get(id(config))
    if done is not None and done[0] is config:
        return done[1]
    regions, profile, reason = resolve_alignment_config(config, on_cuda=on_cuda)
    compile_ = option_bool(_select(config, "alignment.compile"), name="alignment.compile", default=False)
    if regions:
        use_liger = _select(config, "actor_rollout_ref.model.use_liger")
        if option_bool(use_liger, name="actor_rollout_ref.model.use_liger", default=False):
            from ..errors import LigerConflictError

            raise LigerConflictError(
                "actor_rollout_ref.model.use_liger=True replaces the RoPE, RMSNorm and SwiGLU forwards that "
                "alignment patches; set actor_rollout_ref.model.use_liger=False or alignment.regions=[]"
            )
        for role in ("actor", "ref"):
            strategy = _select(config, f"actor_rollout_ref.{role}.strategy")
            if strategy is not None and str(strategy) not in FSDP_STRATEGIES:
                raise AlignmentError(
                    f"actor_rollout_ref.{role}.strategy={strategy}: rlalign-verl patches models built by verl's "
                    f"FSDP engine only; use strategy fsdp or fsdp2, or alignment.regions=[]"
                )
        check_plugin_reaches_workers()
        _kernels(config)
        from ..placement import check_rollout

        check_rollout(profile, _select(config, "actor_rollout_ref.rollout.name"))
        from .model_hook import check_hook_target

        check_hook_target()
        model_type = _model_type(config)
        if model_type is not None:
            from ..families import get_family

            if get_family(model_type).experts is not None:
                check_expert_parallel(_select(config, EP_KEY, 1))
                from ..moe_patch import check_moe_profile  # before Ray: MoE rounding present, opt-in given

                check_moe_profile(model_type, get_profile(profile), regions, _unverified(config))
                from ..options import parse_bool
                from ..regions.inductor_norm import check_compiled_norm_model

                cn_key = "alignment.compiled_norm"
                cn = parse_bool(_select(config, cn_key) or False, name=cn_key)
                check_compiled_norm_model(model_type, cn)
            from ..moe_variant import check_moe_variant_model, parse_moe_variant

            check_moe_variant_model(model_type, parse_moe_variant(_select(config, "alignment.moe_variant")))
        if (
            not (on_cuda if on_cuda is not None else cuda_available())
            and get_profile(profile).device == "cuda"
        ):
            logger.warning(
                "profile %s is a CUDA profile but the driver sees no CUDA device (fine if the workers have GPUs)",
                profile,
            )
    _check_metrics(config)
    _write_worker_settings(config, regions, profile, compile_)
    _check_opt_in_regions(config, regions, profile)
    if regions:
        logger.info(
            "alignment regions=%s profile=%s (%s); actor and ref are patched, critic untouched",
            ",".join(regions),
            profile,
            reason,
        )
    elif _select(config, "alignment") is None:
        logger.debug("%s", reason)  # plain verl run: the plugin stays silent
    else:
        logger.info("%s", reason)
    _validated[id(config)] = (config, (regions, profile))
    return regions, profile
