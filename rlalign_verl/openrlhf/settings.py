"""The OpenRLHF plugin's settings: launcher flags in, env vars out (read back in every Ray worker).

Flags (all optional; stripped from argv before OpenRLHF's own parser sees it):

``--alignment.regions``  comma list of rope, swiglu, rmsnorm (or all / none). Default: none.
``--alignment.engine``   auto | vllm | a profile name (vllm, vllm-eager, vllm-cpu, vllm-cpu-eager, sglang, hf).
                         auto and vllm pick vllm or vllm-eager from OpenRLHF's ``--vllm.enforce_eager``
                         (older flat name ``--enforce_eager``); any other name is used as given. Every
                         aligning worker checks the profile against its device (auto: moved to that
                         device's build, e.g. ``vllm-cpu`` on a CPU-only worker; explicit: an error).
``--alignment.metrics``  true | false: log ``train/mismatch/*`` every step (default true).
``--alignment.collect_rollout_logprobs``  true | false: measure-only mode, make vLLM return the
                         rollout log-probs without turning on OpenRLHF's IS correction (the loss is
                         unchanged). Default false.
``--alignment.unverified``  comma list of unverified profile data to use (``moe``: the vllm profiles' MoE
                         rounding, read from vLLM's source, not yet checked on a GPU). Default: none;
                         ``RLALIGN_UNVERIFIED=moe`` on the launcher is an equivalent spelling.
``--alignment.compiled_norm``  true | false: run the aligned norms compiled as the engine compiles them
                         (``apply_alignment(compiled_norm=True)``; needs a profile with Inductor norm options,
                         i.e. ``--alignment.engine vllm-cpu``, and a dense model). Default false.
``--alignment.moe_variant``  emulate | engine-op: MoE experts + combine in PyTorch (default) or by vLLM CPU's own
                         ``cpu_fused_moe`` (``apply_alignment(moe_variant=...)``; vllm-cpu profiles with swiglu
                         and moe aligned, an MoE model, vLLM's CPU build in the workers).
``--address``            Ray address of an existing cluster (else ``RAY_ADDRESS``, else a local Ray).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AlignmentError, LigerConflictError, ProfileMismatchError
from ..moe_variant import parse_moe_variant
from ..options import parse_bool
from ..profiles import get_profile
from ..regions import normalize_regions
from ..unverified import UNVERIFIED_ENV, parse_unverified, resolve_unverified
from .flags import check_spellings, spellings
from .moe_checks import check_moe_parallel

ENV_REGIONS = "RLALIGN_REGIONS"
ENV_ENGINE = "RLALIGN_ENGINE"
ENV_METRICS = "RLALIGN_METRICS"
ENV_COLLECT = "RLALIGN_COLLECT_ROLLOUT_LOGPROBS"
ENV_AUTO = "RLALIGN_ENGINE_AUTO"
ENV_COMPILED_NORM = "RLALIGN_COMPILED_NORM"
ENV_MOE_VARIANT = "RLALIGN_MOE_VARIANT"
ENV_VARS = (ENV_REGIONS, ENV_ENGINE, ENV_METRICS, ENV_COLLECT, ENV_AUTO, ENV_COMPILED_NORM, ENV_MOE_VARIANT)

FLAG_PREFIX = "--alignment."
FLAGS = (
    "regions",
    "engine",
    "metrics",
    "collect_rollout_logprobs",
    "unverified",
    "compiled_norm",
    "moe_variant",
)

# OpenRLHF flags the plugin reads (all spellings: rlalign_verl/openrlhf/flags.py).
ENFORCE_EAGER_FLAGS = spellings("enforce_eager")
LIGER_FLAGS = spellings("use_liger_kernel")
IS_CORRECTION_LEVEL_FLAGS = spellings("is_correction_level")
IS_CORRECTION_SWITCH_FLAGS = spellings("is_correction_enable")
VLLM_ENGINES_FLAGS = spellings("vllm_num_engines")


@dataclass(frozen=True)
class Settings:
    """What the plugin does in every process of one OpenRLHF run."""

    regions: tuple[str, ...] = ()
    profile: str = "vllm"
    metrics: bool = True
    collect_rollout_logprobs: bool = False
    auto: bool = False
    """``--alignment.engine auto``: each worker moves ``profile`` to its device's build (rlalign_verl.placement)."""
    unverified: tuple[str, ...] = ()
    """``--alignment.unverified``: unverified profile data opted into (rlalign_verl.unverified)."""
    compiled_norm: bool = False
    """``--alignment.compiled_norm``: the workers' norms compiled as the engine compiles them."""
    moe_variant: str = "emulate"
    """``--alignment.moe_variant``: the workers' MoE experts emulated or run by the engine's op."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", normalize_regions(self.regions))
        object.__setattr__(
            self, "unverified", parse_unverified(self.unverified, name="--alignment.unverified")
        )
        object.__setattr__(self, "profile", get_profile(self.profile).name)
        object.__setattr__(self, "moe_variant", parse_moe_variant(self.moe_variant))

    def to_env(self) -> dict[str, str]:
        """The env vars that carry these settings to the Ray workers."""
        return {
            ENV_REGIONS: ",".join(self.regions) or "none",
            ENV_ENGINE: self.profile,
            ENV_METRICS: "1" if self.metrics else "0",
            ENV_COLLECT: "1" if self.collect_rollout_logprobs else "0",
            ENV_AUTO: "1" if self.auto else "0",
            ENV_COMPILED_NORM: "1" if self.compiled_norm else "0",
            ENV_MOE_VARIANT: self.moe_variant,
            UNVERIFIED_ENV: ",".join(
                self.unverified
            ),  # the workers read the resolved opt-in, not their own env
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings the launcher put in the environment, or ``None`` when it did not run."""
        env = os.environ if environ is None else environ
        if not any(k in env for k in ENV_VARS):
            return None
        return cls(
            regions=normalize_regions(env.get(ENV_REGIONS, "none")),
            profile=env.get(ENV_ENGINE, "vllm") or "vllm",
            metrics=parse_bool(env.get(ENV_METRICS, "1"), name=ENV_METRICS),
            collect_rollout_logprobs=parse_bool(env.get(ENV_COLLECT, "0"), name=ENV_COLLECT),
            auto=parse_bool(env.get(ENV_AUTO, "0"), name=ENV_AUTO),
            unverified=parse_unverified(env.get(UNVERIFIED_ENV), name=UNVERIFIED_ENV),
            compiled_norm=parse_bool(env.get(ENV_COMPILED_NORM, "0"), name=ENV_COMPILED_NORM),
            moe_variant=env.get(ENV_MOE_VARIANT) or "emulate",
        )

    def describe(self) -> str:
        auto = " (auto)" if self.auto else ""
        return (
            f"regions={list(self.regions)} profile={self.profile}{auto} metrics={self.metrics} "
            f"collect_rollout_logprobs={self.collect_rollout_logprobs}"
            + (f" unverified={','.join(self.unverified)}" if self.unverified else "")
            + (" compiled_norm" if self.compiled_norm else "")
            + (f" moe_variant={self.moe_variant}" if self.moe_variant != "emulate" else "")
        )


# --- reading OpenRLHF's own flags (left in argv for its parser) ----------------------------------


def flag_value(argv: Sequence[str], names: Sequence[str]) -> str | bool | None:
    """The value of the first of ``names`` found in ``argv``: its argument, ``True`` for a bare switch,
    ``None`` when absent. Handles ``--flag value`` and ``--flag=value``; the last occurrence wins."""
    found: str | bool | None = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                found = nxt if nxt is not None and not nxt.startswith("--") else True
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def switch_on(argv: Sequence[str], names: Sequence[str]) -> bool:
    """Whether a ``store_true`` flag (any of ``names``) is given."""
    value = flag_value(argv, names)
    return value is not None and (value is True or parse_bool(value, name=names[0]))


def rollout_logprobs_requested(argv: Sequence[str]) -> bool:
    """Whether OpenRLHF itself collects rollout log-probs (its IS correction is on)."""
    level = flag_value(argv, IS_CORRECTION_LEVEL_FLAGS)
    if isinstance(level, str) and level.strip().lower() != "off":
        return True
    return switch_on(argv, IS_CORRECTION_SWITCH_FLAGS)


def resolve_profile(engine: str, *, enforce_eager: bool) -> tuple[str, str]:
    """The engine profile for ``--alignment.engine`` and why.

    ``auto``/``vllm``: OpenRLHF always rolls out with vLLM on GPUs, so the compiled ``vllm`` profile, or
    ``vllm-eager`` with ``--vllm.enforce_eager``. Another vLLM profile is taken as given when it agrees with
    ``--vllm.enforce_eager`` (an ``-eager`` profile needs it, a compiled one must not have it).
    """
    name = str(engine).strip().lower()
    if name in ("auto", "vllm"):
        if enforce_eager:
            return "vllm-eager", "vLLM with --vllm.enforce_eager (eager CUDA kernels)"
        return "vllm", "vLLM without --vllm.enforce_eager (compiled graph)"
    profile = get_profile(name)
    if profile.engine != "vllm":
        raise ProfileMismatchError(
            f"--alignment.engine {profile.name} mirrors {profile.engine}, but OpenRLHF samples with vLLM; use "
            f"--alignment.engine auto (or vllm, vllm-eager)"
        )
    if profile.name.endswith("-eager") != enforce_eager:  # eager kernels vs compiled graph: other roundings
        runs = "eager (--vllm.enforce_eager)" if enforce_eager else "compiled (no --vllm.enforce_eager)"
        raise ProfileMismatchError(
            f"--alignment.engine {profile.name} contradicts OpenRLHF's vLLM, which runs {runs}; use "
            f"--alignment.engine auto, or {'drop' if enforce_eager else 'add'} --vllm.enforce_eager"
        )
    return profile.name, "given by --alignment.engine"


def check_opt_in(regions: Sequence[str], profile: str) -> None:
    """lm_head: OpenRLHF builds its vLLM engines without a way for us to set ``head_dtype``; attention: per profile."""
    if "lm_head" in regions:
        raise AlignmentError(
            "--alignment.regions lm_head is not supported with OpenRLHF: the launcher cannot set the vLLM engines' "
            "head_dtype, so trainer and engine heads could disagree; drop lm_head (verl sets both sides)"
        )
    if "attention" in regions:
        from ..profiles import get_profile
        from ..regions.attention import check_attention_supported

        check_attention_supported(get_profile(profile))


def check_compiled_norm_flag(regions: Sequence[str], profile: str, on: bool, argv: Sequence[str]) -> None:
    """``--alignment.compiled_norm``: a profile whose engine compiles its norms, rmsnorm aligned, a dense model."""
    from ..regions.inductor_norm import check_compiled_norm, check_compiled_norm_model
    from .moe_checks import moe_model_type

    check_compiled_norm(get_profile(profile), tuple(regions), on)
    model_type = moe_model_type(argv)
    if model_type is not None:
        check_compiled_norm_model(model_type, on)


def check_moe_variant_flag(regions: Sequence[str], profile: str, variant: str, argv: Sequence[str]) -> str:
    """``--alignment.moe_variant``: engine-op needs a vllm-cpu profile, swiglu and moe, an MoE model."""
    from ..moe_variant import check_moe_variant, check_moe_variant_model
    from .moe_checks import local_model_type

    if not regions:
        return parse_moe_variant(variant)
    variant = check_moe_variant(get_profile(profile), tuple(regions), variant)
    model_type = local_model_type(argv)
    if model_type is not None:
        check_moe_variant_model(model_type, variant)
    return variant


def check_liger(regions: Sequence[str], argv: Sequence[str]) -> None:
    """Refuse Liger kernels together with alignment: both replace the same forwards."""
    if regions and switch_on(argv, LIGER_FLAGS):
        raise LigerConflictError(
            "--ds.use_liger_kernel (older: --use_liger_kernel) replaces the RoPE/RMSNorm/SwiGLU forwards that "
            f"alignment patches (--alignment.regions {','.join(regions)}); drop --ds.use_liger_kernel, or turn "
            "alignment off with --alignment.regions none"
        )


# --- the launcher's own flags ----------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher's parsed flags."""

    settings: Settings
    profile_reason: str
    address: str | None
    openrlhf_argv: list[str]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit(2)
        raise AlignmentError(f"rlalign-verl OpenRLHF launcher: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m rlalign_verl.openrlhf.train_ppo_ray", add_help=False, allow_abbrev=False)
    p.add_argument("--alignment.regions", dest="regions", default="none")
    p.add_argument("--alignment.engine", dest="engine", default="auto")
    p.add_argument("--alignment.metrics", dest="metrics", nargs="?", const="true", default="true")
    p.add_argument(
        "--alignment.collect_rollout_logprobs", dest="collect", nargs="?", const="true", default="false"
    )
    p.add_argument("--alignment.unverified", dest="unverified", default="")
    p.add_argument(
        "--alignment.compiled_norm", dest="compiled_norm", nargs="?", const="true", default="false"
    )
    p.add_argument("--alignment.moe_variant", dest="moe_variant", default="emulate")
    p.add_argument("--address", dest="address", default=None)
    return p


def parse_launcher_args(argv: Sequence[str]) -> LaunchOptions:
    """Split ``argv`` into the plugin's settings and OpenRLHF's own flags; validate the settings.

    Raises ``UnknownRegionError``/``UnknownProfileError``/``LigerConflictError``/``AlignmentError``
    (each naming the fix) before anything starts.
    """
    ns, rest = _parser().parse_known_args(list(argv))
    unknown = [a for a in rest if a.startswith(FLAG_PREFIX)]
    if unknown:
        raise AlignmentError(
            f"unknown flag(s) {unknown}; the plugin's flags are "
            + ", ".join(FLAG_PREFIX + f for f in FLAGS)
            + " (see python -m rlalign_verl.openrlhf.train_ppo_ray --help)"
        )
    check_spellings(rest)
    regions = normalize_regions(ns.regions)
    profile, reason = resolve_profile(ns.engine, enforce_eager=switch_on(rest, ENFORCE_EAGER_FLAGS))
    check_liger(regions, rest)
    check_opt_in(regions, profile)
    unverified = resolve_unverified(ns.unverified, name="--alignment.unverified")
    check_moe_parallel(regions, rest, profile, unverified)
    compiled_norm = parse_bool(ns.compiled_norm, name="--alignment.compiled_norm")
    check_compiled_norm_flag(regions, profile, compiled_norm, rest)
    moe_variant = check_moe_variant_flag(regions, profile, ns.moe_variant, rest)
    settings = Settings(
        regions=regions,
        profile=profile,
        metrics=parse_bool(ns.metrics, name="--alignment.metrics"),
        collect_rollout_logprobs=parse_bool(ns.collect, name="--alignment.collect_rollout_logprobs"),
        auto=str(ns.engine).strip().lower() == "auto",
        unverified=unverified,
        compiled_norm=compiled_norm,
        moe_variant=moe_variant,
    )
    return LaunchOptions(settings=settings, profile_reason=reason, address=ns.address, openrlhf_argv=rest)


# --- reading OpenRLHF's parsed args in the workers ---------------------------------------------------


def get_arg(args: Any, dotted: str, *flat: str, default: Any = None) -> Any:
    """``args.<dotted>`` (OpenRLHF >= 0.10 hierarchical namespace), else the first flat name present."""
    node = args
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            break
    if node is not None:
        return node
    for name in flat:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default
