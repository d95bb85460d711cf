"""Every check of an alignment request, in one place: :func:`validate_request`.

Surfaces call ``validate_request(spec, ...)`` with what they know at that point — a driver before Ray starts knows the
rollout and the checkpoint's ``model_type``; a worker also knows the device and the built model — and each
check runs once the facts it needs are given. Each failure is one line naming the fix
(:class:`~rlalign_verl.base.errors.AlignmentError` subclasses). Torch is imported only for the host checks.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from rlalign_verl.base.errors import (
    AlignmentError,
    ConfigFormatError,
    LigerConflictError,
    ProfileMismatchError,
    UnsupportedModelError,
)
from rlalign_verl.base.options import key_name, key_setting, spelled_as, surface
from rlalign_verl.catalog.compat import check_transformers
from rlalign_verl.catalog.placement import ROLLOUT_ENGINES, check_rollout
from rlalign_verl.catalog.profiles import PROFILES, EngineProfile, get_profile
from rlalign_verl.request.inert import check_inert, check_off
from rlalign_verl.request.regions import region_hooks
from rlalign_verl.request.spec import HEAD_DTYPES, AlignmentSpec

OPT_IN_HINT = (
    "opt in with alignment.experimental.unverified=[moe] (verl) / --alignment.experimental.unverified moe "
    "(OpenRLHF) / apply_alignment(..., unverified=('moe',))"
)


class AttentionUnsupportedError(AlignmentError):
    """The ``attention`` region was asked for on an engine path whose attention cannot be reproduced."""


class HeadDtypeError(AlignmentError):
    """An unknown head dtype, or trainer and engine heads that disagree."""


def parse_head_dtype(value: Any, shown: str, fix: str) -> str:
    """``"float32"`` or ``"model"`` for a head dtype read anywhere (the request, a verl key, a dump, a flag);
    ``shown``: the setting as the user wrote it, ``fix``: what to write instead."""
    key = str(value).strip().lower()
    if key not in HEAD_DTYPES:
        raise HeadDtypeError(f"{shown} is not a head dtype; {fix}")
    return HEAD_DTYPES[key]


_ATTENTION_REFUSAL = {
    "vllm": (
        "vLLM on GPUs runs FlashAttention/FlashInfer, whose decode merges split-KV partial softmaxes in a "
        "batch- and tile-dependent order (vllm/v1/attention/backends/flash_attn.py, flashinfer.py)"
    ),
    "sglang": (
        "SGLang runs FlashInfer/FA3 with split-KV decode in a batch- and tile-dependent order "
        "(python/sglang/srt/layers/attention/flashinfer_backend.py)"
    ),
}

# config attributes of routers this alignment does not mirror, with the values that mean "plain softmax top-k"
_ROUTER_ATTRS = {
    "scoring_func": ("softmax", None),
    "n_group": (None, 1, 0),
    "topk_group": (None, 1, 0),
    "topk_method": (None, "greedy"),
    "routed_scaling_factor": (None, 1.0),
}


def validate_request(
    spec: AlignmentSpec,
    *,
    model_type: str | None = None,
    model_config: Any = None,
    device: str | None = None,
    rollout: str | None = None,
    liger: bool = False,
    expert_parallel: Any = None,
    param_dtype: Any = None,
    class_form: bool = False,
    spelling: str | None = None,
) -> EngineProfile | None:
    """The profile ``spec`` aligns to, after every check the given facts allow; ``None`` when no region is on.

    ``device``: where the model runs (``cpu``/``cuda``): an ``auto`` profile moves to that device's build, an
    explicit one for another device is refused. ``rollout``: the rollout engine's name. ``liger``: the model is
    built with Liger kernels. ``expert_parallel``: the rollout's expert-parallel size (or the flag that sets it);
    the rollout's tensor-parallel size is the request's own ``rollout_tp``. ``param_dtype``: the
    model's parameter dtype. ``class_form``: ``apply_alignment(model=None)``. ``spelling``: how messages name
    keys (``hydra``, ``flag``, ``python``; default: the surface already set, :func:`~rlalign_verl.base.options.
    spelled_as`).
    """
    if not spec.regions:
        with spelled_as(spelling or surface()):
            check_off(spec)
        return None
    with spelled_as(spelling or surface()):
        regions = spec.regions
        exp = spec.experimental
        check_retired_env()
        check_transformers(exp.untested_versions)
        profile = _placed(spec, device, rollout if rollout is not None else spec.rollout)
        if liger:
            raise LigerConflictError(
                "Liger kernels replace the RoPE, RMSNorm and SwiGLU forwards that alignment patches; build the model "
                "without Liger (verl: actor_rollout_ref.model.use_liger=False; OpenRLHF: drop --ds.use_liger_kernel) "
                "or turn alignment off"
            )
        if "rope" in regions and profile.rope.store == "vllm-cpu-kernel":
            from rlalign_verl.catalog.placement import vllm_cpu_kernel_store

            vllm_cpu_kernel_store()  # a host whose kernel rounding is not established is refused before patching
        check_kernels(exp.kernels, exp.compile, device)
        check_inert(spec)
        if "attention" in regions:
            check_attention(profile)
        if exp.compiled_norm:
            check_compiled_norm(profile, regions)
        if exp.moe_variant == "engine-op":
            check_moe_variant(profile, regions)
        for check in region_hooks(regions, "check"):
            check(profile, spec)
        if class_form and "lm_head" in regions:
            raise AlignmentError(
                "the lm_head region needs a model: call apply_alignment(model, ...) on the built model"
            )
        if param_dtype is not None:
            check_param_dtype(param_dtype)
        if model_type is not None:
            check_model(spec, profile, model_type, model_config, expert_parallel)
        return profile


RETIRED_ENV = {
    "RLALIGN_TRITON": ("experimental.kernels", {"hydra": "triton", "flag": "triton", "python": "triton"}),
    "RLALIGN_UNVERIFIED": ("experimental.unverified", {"hydra": "[moe]", "flag": "moe", "python": ("moe",)}),
}
"""Environment variables earlier releases read as a second source of truth, and the setting that replaced each."""


def check_retired_env(environ: Any = None) -> None:
    """Refuse a retired variable that is set: it would be ignored, and the user expects it to act."""
    env = os.environ if environ is None else environ
    spelling = surface()
    for name, (key, values) in RETIRED_ENV.items():
        if env.get(name):
            value = values.get(spelling, values["hydra"])
            setting = (
                f"{key.rsplit('.', 1)[-1]}={value!r}" if spelling == "python" else key_setting(key, value)
            )
            raise ConfigFormatError(
                f"{name} is no longer read (one setting decides, on the driver); unset it and set {setting} instead"
            )


# --- the profile -------------------------------------------------------------------------------


def _placed(spec: AlignmentSpec, device: str | None, rollout: str | None) -> EngineProfile:
    """The profile, moved to ``device``'s build when it came from ``auto``; refusals name the fix."""
    from rlalign_verl.catalog.placement import profile_for_device

    is_auto = isinstance(spec.engine, str) and spec.engine == "auto"
    auto = is_auto or spec.engine_auto
    profile = get_profile("vllm" if is_auto else spec.engine)
    roll = str(rollout or "").strip().lower()
    check_rollout(profile, roll)
    if profile.engine in ROLLOUT_ENGINES and roll in ROLLOUT_ENGINES and roll != profile.engine:
        raise ProfileMismatchError(
            f"alignment.engine={profile.name} is a {profile.engine} profile but the rollout engine is {roll}; use "
            f"alignment.engine=auto (or a {roll} profile)"
        )
    if device is None:
        return profile
    return profile_for_device(profile, device, auto=auto)


# --- switches ----------------------------------------------------------------------------------


def check_kernels(kernels: str, compile_: bool, device: str | None) -> None:
    """``triton``: installed, not together with ``compile``, and only where the model runs on CUDA."""
    if kernels != "triton":
        return
    name = key_name("experimental.kernels")
    if compile_:
        raise AlignmentError(
            f"{name}triton and {key_name('experimental.compile')}true both replace SwiGLU/RoPE; choose one"
            if surface() == "python"
            else f"{name}=triton and {key_name('experimental.compile')}=true both replace SwiGLU/RoPE; choose one"
        )
    if device == "cpu":
        raise AlignmentError(
            f"{name}=triton runs the fused kernels on CUDA only, but this model runs on the CPU (they would be "
            f"ignored); drop it (the PyTorch path is the default)"
        )
    if importlib.util.find_spec("triton") is None:
        raise AlignmentError(
            f"{name}=triton needs the triton package; pip install triton or use kernels torch"
        )


def check_attention(profile: EngineProfile) -> None:
    """The attention region reproduces the vLLM CPU build's attention only (HF: HF's own)."""
    if profile.engine == "hf" or (profile.device == "cpu" and profile.engine == "vllm"):
        return
    why = _ATTENTION_REFUSAL.get(profile.engine, f"no verified attention path for engine {profile.engine!r}")
    raise AttentionUnsupportedError(
        f"the attention region cannot be aligned to profile {profile.name!r}: {why}; drop 'attention' from "
        f"the regions (rope, swiglu, rmsnorm and lm_head do work with this profile)"
    )


def check_compiled_norm(profile: EngineProfile, regions: tuple[str, ...]) -> None:
    on = key_setting("experimental.compiled_norm", "true")
    if not profile.norm_inductor:
        raise AlignmentError(
            f"{on}: profile {profile.name!r} does not run its norms as an Inductor graph the trainer can "
            "reproduce; turn it off (or use a compiled vLLM CPU profile such as vllm-cpu)"
        )
    if "rmsnorm" not in regions:
        raise AlignmentError(f"{on} needs the rmsnorm region; add rmsnorm to the regions")


def check_moe_variant(profile: EngineProfile, regions: tuple[str, ...]) -> None:
    on = key_setting("experimental.moe_variant", "engine-op")
    off = key_setting("experimental.moe_variant", "emulate")
    if not (profile.engine == "vllm" and profile.device == "cpu" and profile.moe is not None):
        raise AlignmentError(
            f"{on} runs vLLM CPU's cpu_fused_moe and mirrors the vllm-cpu profiles only, not {profile.name}; "
            f"use {off}, or engine vllm-cpu / vllm-cpu-eager"
        )
    missing = [r for r in ("swiglu", "moe") if r not in regions]
    if missing:
        raise AlignmentError(
            f"{on} replaces the experts (swiglu region) and the combine (moe region) together; add "
            f"{','.join(missing)} to the regions, or use {off}"
        )


def check_param_dtype(dtype: Any) -> None:
    """bf16 (the engines' dtype) and fp32 master weights run under bf16 compute; fp16 is not verified."""
    name = str(dtype).replace("torch.", "")
    if name in ("float16", "half"):
        raise UnsupportedModelError(
            "the model is float16, but every engine profile mirrors bf16 rounding (fp16 engines are not verified); "
            "load it in bfloat16 (dtype=torch.bfloat16), as the rollout engine runs it, or turn alignment off"
        )
    if name not in ("bfloat16", "float32"):
        raise UnsupportedModelError(
            f"the model's parameters are {name}; alignment mirrors bf16 engines: use a bfloat16 model (or float32 "
            "master weights trained under bf16 autocast / FSDP mixed precision)"
        )


# --- the model -----------------------------------------------------------------------------------


SUPPORTED_SPLIT = (
    "supported: no expert parallel (tensor parallel splits each expert, mirrored by the tp region)"
)


def check_model(
    spec: AlignmentSpec,
    profile: EngineProfile,
    model_type: str,
    config: Any = None,
    expert_parallel: Any = None,
) -> None:
    """Checks that need the architecture (and, where given, its config)."""
    from rlalign_verl.catalog.families import FAMILIES, get_family

    family = get_family(model_type)
    regions = spec.regions
    act = getattr(config, "hidden_act", "silu") if config is not None else "silu"
    mlp_regions = [r for r in ("swiglu", "moe") if r in regions]  # the regions whose forwards compute silu
    if mlp_regions and act not in ("silu", "swish"):
        raise UnsupportedModelError(
            f"hidden_act={act!r}: the {'/'.join(mlp_regions)} region computes silu only; drop "
            f"{','.join(mlp_regions)} from the regions"
        )
    moe = family.experts is not None
    for check in region_hooks(regions, "check_model"):
        check(model_type, config, spec, moe)
    if spec.experimental.moe_variant == "engine-op" and not moe:
        names = ", ".join(f.model_type for f in FAMILIES.values() if f.experts is not None)
        raise UnsupportedModelError(
            f"experimental.moe_variant=engine-op needs an MoE model ({names}), not {model_type}; use "
            "experimental.moe_variant=emulate"
        )
    if not moe:
        _check_dense(spec, model_type)
        return
    aligned = sorted({"swiglu", "moe"} & set(regions))
    if expert_parallel not in (None, 1, "1") and aligned:
        raise AlignmentError(
            f"expert parallel ({expert_parallel}) on {model_type}: expert parallel sums the ranks' expert outputs in "
            f"bf16, which the {'/'.join(aligned)} region cannot mirror ({SUPPORTED_SPLIT}); turn expert parallel off"
        )
    if spec.rollout_tp > 1 and "moe" in regions and "tp" not in regions:
        raise AlignmentError(
            f"rollout tensor parallel {spec.rollout_tp} on {model_type}: the engine splits each expert over the ranks and "
            f"all-reduces their bf16 partial outputs, so the moe region's single combine rounding does not hold "
            f"without the split; add tp to the regions (or drop moe)"
        )
    check_moe_profile(model_type, profile, regions, spec.experimental.unverified)
    for attr, plain in _ROUTER_ATTRS.items():
        value = getattr(config, attr, None) if config is not None else None
        if value not in plain:
            raise UnsupportedModelError(
                f"{model_type}: {attr}={value!r} is not supported; rlalign-verl aligns softmax top-k routing only (no "
                "grouped top-k, sigmoid scoring or routed scaling); turn alignment off for this model"
            )


def _check_dense(spec: AlignmentSpec, model_type: str) -> None:
    """A dense model: MoE-only settings would wrap or change nothing, so they are refused, not ignored."""
    if "moe" in spec.regions:
        raise UnsupportedModelError(
            f"the moe region aligns MoE routers and expert combines, and {model_type} is a dense model (it has "
            "none): it would align nothing; drop moe from the regions"
        )
    if "moe" in spec.experimental.unverified:
        raise UnsupportedModelError(
            f"experimental.unverified=[moe] opts into MoE rounding data, which the dense {model_type} never uses; "
            "drop it from experimental.unverified"
        )


def check_moe_profile(
    model_type: str, profile: EngineProfile, regions: tuple[str, ...], unverified: tuple[str, ...] = ()
) -> None:
    """swiglu/moe on an MoE model need the profile's MoE rounding, and unverified data the explicit opt-in."""
    if not {"swiglu", "moe"} & set(regions):
        return
    if profile.moe is None:
        known = ", ".join(p.name for p in PROFILES.values() if p.moe is not None)
        raise UnsupportedModelError(
            f"{model_type}: profile {profile.name} has no MoE expert/router rounding yet (supported: {known}); "
            "align only rope,rmsnorm for this model or use one of those profiles"
        )
    if not profile.moe.verified and "moe" not in unverified:
        raise UnsupportedModelError(
            f"{model_type}: profile {profile.name}'s MoE rounding is read from source and UNVERIFIED (not yet run "
            f"against the engine's ops: python scripts/gpu_moe_check.py on a GPU with {profile.engine} installed "
            f"checks it); {OPT_IN_HINT}, or align only rope,rmsnorm"
        )
