"""The OpenRLHF plugin's settings: launcher flags in, one env var out (read back in every Ray worker).

The alignment request is the same :class:`~rlalign_verl.request.spec.AlignmentSpec` verl builds, written as flags
(stripped from argv before OpenRLHF's own parser sees it):

``--alignment.regions``  comma list of rope, swiglu, rmsnorm (all = the three; + opt-in attention, moe). Default none.
``--alignment.engine``   auto | vllm | a profile name (vllm, vllm-eager, vllm-cpu, vllm-cpu-eager). auto and vllm
                         pick vllm or vllm-eager from OpenRLHF's ``--vllm.enforce_eager`` (older flat name
                         ``--enforce_eager``); every aligning worker checks the profile against its device (auto:
                         moved to that device's build, e.g. ``vllm-cpu`` on a CPU-only worker; explicit: an error).
``--alignment.metrics``  true | false: log ``train/mismatch/*`` every step (default true).
``--alignment.verify.<key>``  the in-run A/B (``every``, ``max_seqs``, ``on_worse``, ``enable`` ...; see verl's).
``--alignment.doctor.enable``  true | false: ``mismatch/doctor/*`` every step and a line when the gap is not
                         rounding (docs/reading-a-mismatch.md); at launch, OpenRLHF flags that confound the gap
                         (top-p with collected log-probs, async training, agent rollouts, unequal micro batches)
                         are named, and an error stops the launch. Default true.
``--alignment.doctor.allow``  comma list of finding keys whose start-up error becomes a warning (e.g. top_p_top_k).
``--alignment.experimental.<key>``  attention, compiled_norm, moe_variant, kernels, compile, unverified,
                         metrics_quantiles, untested_versions (docs/openrlhf.md; head_dtype goes with lm_head,
                         which OpenRLHF refuses).
``--alignment.collect_rollout_logprobs``  true | false: measure-only mode, make vLLM return the rollout
                         log-probs without turning on OpenRLHF's IS correction (the loss is unchanged). Default false.
``--address``            Ray address of an existing cluster (else ``RAY_ADDRESS``, else a local Ray).

The launcher validates the request before Ray starts (with regions on, also what the verl driver checks: the
checkpoint of ``--actor.model_name_or_path``, its architecture, ``--ds.param_dtype`` and
``--vllm.tensor_parallel_size``; :mod:`rlalign_verl.openrlhf.model_checks`) and hands it to the workers in one
env var, :data:`ENV` (JSON); the workers read only that.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlalign_verl.base.errors import AlignmentError, ConfigFormatError, ProfileMismatchError
from rlalign_verl.base.options import parse_bool
from rlalign_verl.catalog.profiles import get_profile
from rlalign_verl.openrlhf.flags import (
    check_abbreviations,
    check_spellings,
    check_switch_values,
    last_given,
    spellings,
)
from rlalign_verl.openrlhf.model_checks import check_checkpoint, rollout_tp
from rlalign_verl.openrlhf.moe_checks import expert_parallel_flag
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import AlignmentSpec, refuse_resolved_keys

ENV = "RLALIGN_OPENRLHF"
"""The one env var carrying the launcher's settings (JSON) to every Ray worker."""
FLAG_PREFIX = "--alignment."
SWITCHES = (
    "metrics",
    "collect_rollout_logprobs",
    "verify",
    "verify.enable",
    "verify.ladder",
    "verify.skip_unverified_engine",
    "doctor",
    "doctor.enable",
    "experimental.compile",
    "experimental.compiled_norm",
    "experimental.metrics_quantiles",
    "experimental.untested_versions",
    # old spellings: a bare flag still reaches the spec, which names the new key
    "compile",
    "compiled_norm",
    "metrics_quantiles",
)
"""Boolean flags: given bare (``--alignment.metrics``) they mean true."""

# OpenRLHF flags the plugin reads (all spellings: rlalign_verl/openrlhf/flags.py).
ENFORCE_EAGER_FLAGS = spellings("enforce_eager")
LIGER_FLAGS = spellings("use_liger_kernel")
IS_CORRECTION_LEVEL_FLAGS = spellings("is_correction_level")
IS_CORRECTION_SWITCH_FLAGS = spellings("is_correction_enable")
VLLM_ENGINES_FLAGS = spellings("vllm_num_engines")
ROLLOUT = "vllm"
"""OpenRLHF's rollout engine (its PPO trainer samples with vLLM engines)."""


@dataclass(frozen=True)
class Settings:
    """What the plugin does in every process of one OpenRLHF run: the resolved spec and measure-only mode."""

    spec: AlignmentSpec = field(default_factory=lambda: AlignmentSpec(engine="vllm", rollout=ROLLOUT))
    collect_rollout_logprobs: bool = False

    @classmethod
    def build(
        cls,
        regions: Any = (),
        profile: str = "vllm",
        metrics: bool = True,
        collect_rollout_logprobs: bool = False,
        auto: bool = False,
        **experimental: Any,
    ) -> Settings:
        """Settings from keywords (``experimental``: ``compiled_norm=``, ``unverified=`` ...), as the launcher
        would resolve them."""
        spec = AlignmentSpec.parse(
            {"regions": regions, "engine": profile, "metrics": metrics, "experimental": experimental}
        )
        return cls(spec.replace(engine_auto=auto, rollout=ROLLOUT), collect_rollout_logprobs)

    # the spec's fields the OpenRLHF hooks read
    @property
    def regions(self) -> tuple[str, ...]:
        return self.spec.regions

    @property
    def profile(self) -> str:
        return self.spec.engine

    @property
    def metrics(self) -> bool:
        return self.spec.metrics

    @property
    def auto(self) -> bool:
        return self.spec.engine_auto

    def to_env(self) -> dict[str, str]:
        """The env var that carries these settings to the Ray workers."""
        return {
            ENV: json.dumps(
                {"spec": self.spec.to_dict(), "collect_rollout_logprobs": self.collect_rollout_logprobs}
            )
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings the launcher put in the environment, or ``None`` when it did not run."""
        env = os.environ if environ is None else environ
        raw = env.get(ENV)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            spec, collect = data["spec"], data.get("collect_rollout_logprobs", False)
        except (ValueError, KeyError, TypeError):
            raise ConfigFormatError(
                f"{ENV} is not the launcher's JSON; start the run with the launcher"
            ) from None
        return cls(AlignmentSpec.from_json(spec), parse_bool(collect, name="collect_rollout_logprobs"))

    def describe(self) -> str:
        auto = " (auto)" if self.auto else ""
        extra = self.spec.describe().split(" experimental: ", 1)
        return (
            f"regions={list(self.regions)} profile={self.profile}{auto} metrics={self.metrics} "
            f"collect_rollout_logprobs={self.collect_rollout_logprobs}"
            + (f" experimental: {extra[1]}" if len(extra) == 2 else "")
        )


# --- reading OpenRLHF's own flags (left in argv for its parser) ----------------------------------


def flag_value(argv: Sequence[str], names: Sequence[str]) -> str | bool | None:
    """The value of the first of ``names`` found in ``argv``: its argument, ``True`` for a bare switch,
    ``None`` when absent. Handles ``--flag value`` and ``--flag=value``; the last occurrence wins."""
    given = last_given(argv, names)
    return None if given is None else given[1]


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


def check_lm_head(regions: Sequence[str]) -> None:
    """lm_head: OpenRLHF builds its vLLM engines without a way for us to set ``head_dtype``."""
    if "lm_head" in regions:
        raise AlignmentError(
            "--alignment.regions lm_head is not supported with OpenRLHF: the launcher cannot set the vLLM engines' "
            "head_dtype, so trainer and engine heads could disagree; drop lm_head (verl sets both sides)"
        )


# --- the launcher's own flags ----------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher's parsed flags."""

    settings: Settings
    profile_reason: str
    address: str | None
    openrlhf_argv: list[str]


def split_argv(argv: Sequence[str]) -> tuple[dict[str, Any], str | None, list[str]]:
    """``(--alignment.* values as a nested dict, --address, the rest for OpenRLHF)``.

    ``--flag value``, ``--flag=value`` and a bare ``--flag`` (true) are accepted; the last occurrence wins.
    """
    values: dict[str, Any] = {}
    address: str | None = None
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name.startswith(FLAG_PREFIX) or name == "--address":
            if not eq:
                has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
                if not has_value and name[len(FLAG_PREFIX) :] not in SWITCHES:
                    raise AlignmentError(f"{name} needs a value, e.g. {name} <value> (or {name}=<value>)")
                value = args[i + 1] if has_value else "true"
                i += 1 if has_value else 0
            if name == "--address":
                address = value
            else:
                node = values
                *parents, leaf = name[len(FLAG_PREFIX) :].split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                    if not isinstance(node, dict):
                        raise ConfigFormatError(
                            f"{name} conflicts with {FLAG_PREFIX}{part}; give one of them"
                        )
                if isinstance(node.get(leaf), dict):  # --alignment.verify after --alignment.verify.every
                    raise ConfigFormatError(
                        f"{name} conflicts with the {name}.* flags before it; give one of them"
                    )
                node[leaf] = value
        else:
            rest.append(arg)
        i += 1
    return values, address, rest


def parse_launcher_args(argv: Sequence[str], *, checkpoint: bool = True) -> LaunchOptions:
    """Split ``argv`` into the plugin's settings and OpenRLHF's own flags; validate the settings.

    Every bad setting raises one :class:`~rlalign_verl.base.errors.AlignmentError` line naming the fix, before
    anything starts: the request first, then (regions on, ``checkpoint``) what the verl driver checks too, the
    checkpoint, its architecture and the dtypes (:mod:`rlalign_verl.openrlhf.model_checks`).
    """
    values, address, rest = split_argv(argv)
    collect = parse_bool(
        values.pop("collect_rollout_logprobs", False), name="--alignment.collect_rollout_logprobs"
    )
    refuse_resolved_keys(values, "flag")
    spec = AlignmentSpec.parse(values, spelling="flag")
    check_spellings(rest)
    check_abbreviations(rest)
    check_switch_values(rest)
    profile, reason = resolve_profile(spec.engine, enforce_eager=switch_on(rest, ENFORCE_EAGER_FLAGS))
    # the rollout's TP size is a fact of the rollout, read from OpenRLHF's flag as its parser reads it (the tp
    # region mirrors it); like the verl driver, only an aligned run reads it
    tp = rollout_tp(rest) if spec.regions else 1
    spec = spec.replace(engine=profile, engine_auto=spec.engine == "auto", rollout=ROLLOUT, rollout_tp=tp)
    check_lm_head(spec.regions)
    expert_parallel = expert_parallel_flag(rest)
    placed = validate_request(
        spec,
        rollout=ROLLOUT,
        liger=switch_on(rest, LIGER_FLAGS),
        expert_parallel=expert_parallel,
        spelling="flag",
    )
    if placed is not None and checkpoint:
        check_checkpoint(spec, placed, rest, expert_parallel)
    return LaunchOptions(Settings(spec, collect), profile_reason=reason, address=address, openrlhf_argv=rest)


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
