"""One alignment request, one value: :class:`AlignmentSpec`.

Every surface builds it with :meth:`AlignmentSpec.parse` (verl's Hydra ``alignment`` node, OpenRLHF's
``--alignment.*`` flags, ``apply_alignment``'s keywords, diagnose's settings) and every check runs in
:func:`rlalign_verl.request.checks.validate_request` (which imports this module, never the other way round). The value travels to the workers once, as
JSON (:meth:`to_json` / :meth:`from_json`): one ``model.override_config`` key in verl, one env var in OpenRLHF.

What a user sets::

    regions   rope, swiglu, rmsnorm (all = the three) + opt-in attention, lm_head, moe; [] = off
    engine    auto (from the rollout settings) or a profile name (rlalign-verl profiles)
    metrics   log mismatch/* every step
    verify    the in-run A/B against the rollout engine (VerifySpec)
    doctor    start-up confounder checks and per-step signatures (DoctorSpec)
    experimental.*   CPU-engine and unverified switches (Experimental)

Torch-free on purpose: drivers parse and validate before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rlalign_verl.base.errors import ConfigFormatError
from rlalign_verl.base.options import key_name, parse_bool, spelled_as
from rlalign_verl.request.regions import normalize_regions
from rlalign_verl.request.values import bad_value, choice, decode_spec, given, integer, names, plain, section

ATTENTION_VARIANTS: tuple[str, ...] = ("engine-op", "sdpa-fp32")
HEAD_DTYPES: dict[str, str] = {"float32": "float32", "fp32": "float32", "model": "model", "bfloat16": "model",
                               "bf16": "model"}  # fmt: skip
MOE_VARIANTS: tuple[str, ...] = ("emulate", "engine-op")
KERNELS: tuple[str, ...] = ("torch", "triton")
UNVERIFIED_NAMES: tuple[str, ...] = ("moe",)
ON_WORSE: tuple[str, ...] = ("stop", "warn")

DEFAULT_VERIFY_EVERY = 10
"""Verify at step 1 and every this many steps (benchmarks/verify_cost.py measures the cost)."""
DEFAULT_VERIFY_MAX_SEQS = 64
MIN_VERIFY_SEQS = 8
"""The fewest sequences a verify verdict (or a doctor's) is decided on: below it the bootstrap interval sits on a
handful of repeated values (the reason: :data:`rlalign_verl.measure.intervals.MIN_UNITS`, which is this number);
a smaller ``verify.max_seqs`` is refused."""


@dataclass(frozen=True)
class VerifySpec:
    """The in-run check that alignment brings the trainer closer to the rollout engine (:mod:`.verify`).

    At step 1 and every ``every`` steps the actor recomputes up to ``max_seqs`` sequences a second time with
    alignment switched off; the callback compares both with the rollout's log-probs (paired, bootstrap 95%
    interval) and logs ``mismatch/verify/*``.
    """

    enable: bool = True
    """Off: no verify steps, except the forced step-1 check of an engine the profile was not verified on."""
    every: int = DEFAULT_VERIFY_EVERY
    """Verify at step 1 and every ``every`` steps after it (0: step 1 only)."""
    max_seqs: int = DEFAULT_VERIFY_MAX_SEQS
    """At most this many sequences of the step's batch are recomputed unaligned."""
    on_worse: str = "stop"
    """First verify step, alignment separated-worse than none: ``stop`` the run before the first update, or ``warn``."""
    on_worse_later: str = "warn"
    """Later verify steps, separated-worse: ``warn`` or ``stop``."""
    ladder: bool = False
    """Step 1 only: the gap for none / each region / all on the same subsample (costs one pass per rung)."""
    skip_unverified_engine: bool = False
    """With ``enable=false``: also skip the step-1 check that an unverified (engine, version, path) forces."""


@dataclass(frozen=True)
class DoctorSpec:
    """ "Is it rounding or a bug?" (:mod:`rlalign_verl.measure.doctor`, :mod:`rlalign_verl.verl.doctor_config`)."""

    enable: bool = True
    """Start-up confounder checks (verl driver) and ``mismatch/doctor/*`` every step."""
    allow: tuple[str, ...] = ()
    """Findings acknowledged: their start-up errors become warnings (``doctor_findings.FINDING_KEYS``)."""


@dataclass(frozen=True)
class Experimental:
    """Switches most GPU users never touch: CPU-engine ops, compiled variants, unverified data."""

    attention: str = "engine-op"
    """With the ``attention`` region: ``engine-op`` (the vLLM CPU build's own op) or ``sdpa-fp32``."""
    head_dtype: str = "float32"
    """With the ``lm_head`` region: the engine head's dtype, ``float32`` or ``model`` (bf16)."""
    compiled_norm: bool = False
    """``vllm-cpu`` with rmsnorm: the norms' forwards compiled by Inductor as the engine compiles them."""
    moe_variant: str = "emulate"
    """MoE experts + combine: ``emulate`` (PyTorch) or ``engine-op`` (vLLM CPU's ``cpu_fused_moe``)."""
    kernels: str = "torch"
    """SwiGLU/RoPE forwards on CUDA: ``torch`` or the opt-in ``triton`` kernels (not yet run on a GPU)."""
    compile: bool = False
    """SwiGLU and RoPE as Inductor-compiled functions (bit-identical, faster)."""
    unverified: tuple[str, ...] = ()
    """Profile data not yet checked against the engine that you opt into: ``moe``."""
    metrics_quantiles: bool = True
    """Log the p50/p90/p99 of |Δlogp| (one sort per step)."""
    untested_versions: bool = False
    """Align under a transformers outside the tested range (:data:`rlalign_verl.catalog.compat.TRANSFORMERS_TESTED`)."""


_VERIFY_KEYS = tuple(f.name for f in fields(VerifySpec))
_EXPERIMENTAL_KEYS = tuple(f.name for f in fields(Experimental))
_DOCTOR_KEYS = tuple(f.name for f in fields(DoctorSpec))
TOP_KEYS = ("regions", "engine", "metrics", "verify", "doctor", "experimental")
"""Keys a user writes at the top of the ``alignment`` group (the driver adds :data:`RESOLVED_KEYS`)."""
RESOLVED_KEYS = ("engine_auto", "rollout", "rollout_tp")
_RESOLVED_FROM = {"engine_auto": "engine=auto", "rollout": "the rollout engine's name",
                  "rollout_tp": "the rollout's tensor-parallel size (verl: actor_rollout_ref.rollout."
                                "tensor_model_parallel_size; OpenRLHF: --vllm.tensor_parallel_size)"}  # fmt: skip


def refuse_resolved_keys(data: Mapping, spelling: str | None = None) -> None:
    """A user's ``alignment`` settings never hold :data:`RESOLVED_KEYS`: the driver sets them (a value given by hand
    would be overwritten or trusted unchecked), so one is refused in one line naming where it comes from."""
    for key in RESOLVED_KEYS:
        if key in data:
            raise ConfigFormatError(
                f"{key_name(key, spelling)} is set by the driver from {_RESOLVED_FROM[key]}; remove it"
            )


MOVED = {k: f"experimental.{k}" for k in _EXPERIMENTAL_KEYS}
"""Old top-level spellings -> their key now (a one-line error names it; nothing is silently ignored)."""


@dataclass(frozen=True)
class AlignmentSpec:
    """One alignment request (frozen). Build it with :meth:`parse`; check it with
    :func:`rlalign_verl.request.checks.validate_request`."""

    regions: tuple[str, ...] = ()
    engine: Any = "auto"
    """``auto`` or a profile name (:data:`rlalign_verl.catalog.profiles.PROFILES`); in-process, also an
    :class:`~rlalign_verl.catalog.profiles.EngineProfile` object (a user-defined variant: it cannot travel as JSON)."""
    metrics: bool = True
    verify: VerifySpec = field(default_factory=VerifySpec)
    doctor: DoctorSpec = field(default_factory=DoctorSpec)
    experimental: Experimental = field(default_factory=Experimental)
    engine_auto: bool = False
    """Set by the driver that resolved ``engine=auto``: a worker may move the profile to its device's build."""
    rollout: str = ""
    """Set by the driver: the run's rollout engine (``vllm``, ``sglang``; empty: unknown)."""
    rollout_tp: int = 1
    """The rollout's tensor-parallel size, a fact of the rollout like compiled/eager: set by the driver (verl's
    ``actor_rollout_ref.rollout.tensor_model_parallel_size``, OpenRLHF's ``--vllm_tensor_parallel_size``), the
    Python keyword ``rollout_tp=``, or a dump header's ``tensor_parallel_size``. The ``tp`` region mirrors it."""

    # --- building ------------------------------------------------------------------------------

    @classmethod
    def parse(
        cls, value: Any = None, /, *, spelling: str = "hydra", needs_regions: bool = False, **kwargs: Any
    ) -> AlignmentSpec:
        """The spec from a mapping (a Hydra node, a dict: :data:`TOP_KEYS`), a JSON string, a spec, or the
        Python keywords of ``apply_alignment`` (``regions=``, ``engine=``, ``compile=``, ``attention=`` ...);
        keywords given with a mapping are merged into it, section by section.

        Unknown keys, old spellings, keys given twice and bad values raise :class:`ConfigFormatError` (one line
        naming the key as ``spelling`` writes it). Region and profile names are checked here. ``needs_regions``:
        a mapping without ``regions`` is refused (a missing ``regions`` otherwise means off, as in the
        plugin's default config).
        """
        if isinstance(value, AlignmentSpec) and not kwargs:
            return value
        if isinstance(value, str):
            value = decode_spec(value)
        data = plain(value) if value is not None else {}
        with spelled_as(spelling):
            if not isinstance(data, Mapping):
                raise ConfigFormatError(
                    f"the alignment settings are a {type(data).__name__} ({data!r}), not a mapping; give e.g. "
                    f"{key_name('regions')}{'' if spelling == 'python' else '='}[rope]"
                )
            data = dict(data)
            for key, given_value in _from_keywords(kwargs).items():
                node = plain(data.get(key))
                if (
                    key in ("verify", "doctor")
                    and isinstance(node, Mapping)
                    and not isinstance(given_value, Mapping)
                ):
                    given_value = section({key: given_value}, key)  # verify=False is verify.enable=False
                both = isinstance(given_value, Mapping) and isinstance(node, Mapping)
                data[key] = {**node, **given_value} if both else given_value
            _check_keys(data, TOP_KEYS + RESOLVED_KEYS, "")  # a misspelt "region" is named as such first
            if needs_regions and "regions" not in data:
                raise ConfigFormatError(
                    "the alignment spec names no regions (a spec without them aligns nothing); add "
                    '"regions": ["rope", "swiglu", "rmsnorm"] (or [] to turn alignment off)'
                )
            return _build(data)

    @classmethod
    def from_json(cls, text: str | Mapping) -> AlignmentSpec:
        """The spec a driver wrote with :meth:`to_json` (a JSON string or its decoded mapping)."""
        return cls.parse(decode_spec(text) if isinstance(text, str) else text, spelling="hydra")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples as lists) that :meth:`parse` reads back to an equal spec."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        if not isinstance(self.engine, str):
            from rlalign_verl.catalog.profiles import PROFILES

            if PROFILES.get(self.engine.name) != self.engine:
                raise ConfigFormatError(
                    f"the custom engine profile {self.engine.name!r} cannot travel to other processes as JSON; "
                    "register it in rlalign_verl.catalog.profiles.PROFILES in every process, or use a built-in profile"
                )
            return self.replace(engine=self.engine.name).to_json()
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def replace(self, **changes: Any) -> AlignmentSpec:
        """A copy with top-level fields changed (``verify=`` / ``experimental=`` take a dataclass or a dict)."""
        for name in ("verify", "experimental"):
            if isinstance(changes.get(name), Mapping):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    # --- reading -------------------------------------------------------------------------------

    @property
    def on(self) -> bool:
        """Whether any region is aligned."""
        return bool(self.regions)

    def profile(self):  # -> EngineProfile (import kept local: profiles is data, but keep parse cheap)
        """The engine profile (``engine`` must be resolved, i.e. not ``auto``)."""
        from rlalign_verl.catalog.profiles import get_profile

        if isinstance(self.engine, str) and self.engine == "auto":
            raise ConfigFormatError("alignment.engine=auto is not resolved yet; the driver resolves it")
        return get_profile(self.engine)

    def describe(self) -> str:
        """One line: what is aligned, to which profile, and the non-default switches."""
        exp = self.experimental
        default = Experimental()
        extra = [
            f"{k}={','.join(v) if isinstance(v, tuple) else v}"
            for k, v in dataclasses.asdict(exp).items()
            if v != getattr(default, k) and not isinstance(v, list)
        ]
        tail = f" experimental: {' '.join(extra)}" if extra else ""
        engine = self.engine if isinstance(self.engine, str) else self.engine.name
        tp = f" rollout_tp={self.rollout_tp}" if self.rollout_tp > 1 else ""
        return f"regions={','.join(self.regions) or 'none'} profile={engine}{tp}{tail}"


# --- parsing helpers -----------------------------------------------------------------------------


_KEYWORDS = {
    "regions": "regions",
    "engine": "engine",
    "metrics": "metrics",
    "verify": "verify",
    "doctor": "doctor",
    "rollout_tp": "rollout_tp",
    **{k: f"experimental.{k}" for k in _EXPERIMENTAL_KEYS},
}
"""``apply_alignment`` keyword -> spec key (the Python convenience form)."""


def _from_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        key = _KEYWORDS.get(name)
        if key is None:
            raise ConfigFormatError(
                f"unknown alignment keyword {name}=; valid: {', '.join(sorted(_KEYWORDS))}"
            )
        if value is None and name not in ("regions",):
            continue  # None: the default
        head, _, tail = key.partition(".")
        if tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[key] = value
    return out


def _check_keys(data: Mapping, allowed: tuple[str, ...], prefix: str) -> None:
    import difflib

    for raw in data:
        key = str(raw)
        if key in allowed:
            continue
        dotted = f"{prefix}{key}"
        if not prefix and key in MOVED:
            raise ConfigFormatError(
                f"{key_name(key)} moved to {key_name(MOVED[key])}; rename it "
                f"(the top level holds {', '.join(k for k in TOP_KEYS if k != 'experimental')})"
            )
        # near misses among this level's keys and, at the top, the keys that moved below it
        candidates = {prefix + k: k for k in allowed if k not in RESOLVED_KEYS}
        if not prefix:
            candidates.update({new: old for old, new in MOVED.items()})
        near = difflib.get_close_matches(key, list(candidates.values()), n=1)
        hint = ""
        if near:
            full = next(full for full, short in candidates.items() if short == near[0])
            hint = f"did you mean {key_name(full)}? "
        raise ConfigFormatError(
            f"unknown alignment key {key_name(dotted)}; {hint}valid: "
            + ", ".join(key_name(prefix + k) for k in allowed if k not in RESOLVED_KEYS)
        )


def _build(data: Mapping) -> AlignmentSpec:
    _check_keys(data, TOP_KEYS + RESOLVED_KEYS, "")
    v = section(data, "verify")
    _check_keys(v, _VERIFY_KEYS, "verify.")
    d = section(data, "doctor")
    _check_keys(d, _DOCTOR_KEYS, "doctor.")
    x = section(data, "experimental")
    _check_keys(x, _EXPERIMENTAL_KEYS, "experimental.")
    default_v, default_x = VerifySpec(), Experimental()

    def flag(section: dict, name: str, default: bool, prefix: str) -> bool:
        value = section.get(name)
        return default if value is None else parse_bool(value, name=key_name(prefix + name).rstrip("="))

    verify = VerifySpec(
        enable=flag(v, "enable", default_v.enable, "verify."),
        every=integer(v.get("every", default_v.every), "verify.every", 0),
        max_seqs=integer(
            v.get("max_seqs", default_v.max_seqs),
            "verify.max_seqs",
            MIN_VERIFY_SEQS,
            why=f"a verdict needs >= {MIN_VERIFY_SEQS} sequences (fewer give no interval)",
        ),
        on_worse=choice(v.get("on_worse", default_v.on_worse), ON_WORSE, "verify.on_worse"),
        on_worse_later=choice(
            v.get("on_worse_later", default_v.on_worse_later), ON_WORSE, "verify.on_worse_later"
        ),
        ladder=flag(v, "ladder", default_v.ladder, "verify."),
        skip_unverified_engine=flag(v, "skip_unverified_engine", default_v.skip_unverified_engine, "verify."),
    )
    from rlalign_verl.request.findings import FINDING_KEYS  # torch- and verl-free

    doctor = DoctorSpec(
        enable=flag(d, "enable", True, "doctor."),
        allow=names(d.get("allow"), FINDING_KEYS, "doctor.allow"),
    )
    experimental = Experimental(
        attention=choice(
            given(x, "attention", default_x.attention),
            ATTENTION_VARIANTS,
            "experimental.attention",
        ),  # fmt: skip
        head_dtype=choice(
            given(x, "head_dtype", default_x.head_dtype),
            ("float32", "model"),
            "experimental.head_dtype",
            HEAD_DTYPES,
        ),  # fmt: skip
        compiled_norm=flag(x, "compiled_norm", default_x.compiled_norm, "experimental."),
        moe_variant=choice(
            given(x, "moe_variant", default_x.moe_variant),
            MOE_VARIANTS,
            "experimental.moe_variant",
        ),  # fmt: skip
        kernels=choice(given(x, "kernels", default_x.kernels), KERNELS, "experimental.kernels"),
        compile=flag(x, "compile", default_x.compile, "experimental."),
        unverified=names(x.get("unverified"), UNVERIFIED_NAMES, "experimental.unverified"),
        metrics_quantiles=flag(x, "metrics_quantiles", default_x.metrics_quantiles, "experimental."),
        untested_versions=flag(x, "untested_versions", default_x.untested_versions, "experimental."),
    )
    regions_value = plain(data.get("regions"))
    if "regions" in data and regions_value is None:  # missing means off; an explicit null is a typo or a bug
        raise bad_value(
            "regions",
            None,
            "give a list of region names, e.g. [rope,swiglu,rmsnorm], or [] to turn it off",
        )
    if isinstance(regions_value, bool | int | float):
        raise bad_value("regions", regions_value, "give a list of region names, e.g. [rope,swiglu,rmsnorm]")
    from rlalign_verl.catalog.profiles import EngineProfile, get_profile

    engine = data.get("engine")
    engine = "auto" if engine is None else engine
    if not isinstance(engine, EngineProfile) and not engine:  # False/0/'' never mean auto
        raise bad_value("engine", engine, "give auto or a profile name (rlalign-verl profiles lists them)")
    if not isinstance(engine, EngineProfile):
        engine = str(engine).strip().lower()
        engine = engine if engine == "auto" else get_profile(engine).name
    rollout = data.get("rollout")
    rollout = "" if rollout is None else rollout
    if not isinstance(rollout, str):
        raise bad_value("rollout", rollout, "the driver writes the rollout engine's name (vllm, sglang)")
    rollout = rollout.strip().lower()
    rollout_tp = data.get("rollout_tp")
    rollout_tp = 1 if rollout_tp is None else integer(rollout_tp, "rollout_tp", 1)
    engine_auto = data.get("engine_auto")
    engine_auto = False if engine_auto is None else parse_bool(engine_auto, name="engine_auto")
    return AlignmentSpec(
        regions=normalize_regions(regions_value),
        engine=engine,
        metrics=True
        if data.get("metrics") is None
        else parse_bool(data["metrics"], name=key_name("metrics").rstrip("=")),
        verify=verify,
        doctor=doctor,
        experimental=experimental,
        engine_auto=engine_auto and not (isinstance(engine, str) and engine == "auto"),
        rollout=rollout,
        rollout_tp=rollout_tp,
    )
