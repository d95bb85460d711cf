"""The region registry: one row per rounding region, and the region names of a request.

A row says what the rest of the package needs to know about a region: whether ``all`` includes it, the
:class:`~rlalign_verl.catalog.profiles.EngineProfile` field that holds the engine's rounding there, the model
modules whose forward it replaces (checked by ``get_alignment``), whether the step-1 verify ladder recomputes it
alone, for a region that binds its own modules, the function that plans those bindings (``module:function``
in :mod:`rlalign_verl.align`, loaded by the patcher), and the region's own request rules (``check``,
``check_model``, ``startup``), which live with its data in :mod:`rlalign_verl.catalog`. Adding a region is its math
in ``rlalign_verl/align/regions/``, one row here and its data with its rules: a profile field where the engine's
paths round differently, else a ``catalog/profiles_<name>.py`` keyed by the profile's engine and device (``tp``).
Torch-free: the driver reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlalign_verl.base.errors import ConfigFormatError, UnknownRegionError
from rlalign_verl.base.options import key_name
from rlalign_verl.catalog import profiles_tp


@dataclass(frozen=True)
class Region:
    """One rounding region of the trainer's forward that alignment can make round like the engine."""

    name: str
    summary: str
    in_all: bool
    """Part of ``all`` (and of the default request); the others are turned on by name only."""
    profile_field: str | None
    """The ``EngineProfile`` field with the engine's rounding here (``None``: the region reads another fact: a request
    setting, or the engine's own data, e.g. ``tp``'s all-reduce, :func:`rlalign_verl.catalog.profiles_tp.reduction`)."""
    wraps: tuple[str, ...] = ()
    """Family roles (:class:`~rlalign_verl.catalog.families.ModelFamily` fields) whose forward it replaces."""
    rung: bool = False
    """The step-1 verify ladder recomputes the log-probs with this region alone aligned."""
    shows: str | None = None
    """The request setting ``describe`` prints with the region (``experimental.attention``, ``rollout_tp``)."""
    only_tp: bool = False
    """Changes nothing at rollout tensor-parallel size 1 (its rung is then left out of the ladder)."""
    plan: tuple[str, ...] = ()
    """``module:function`` planners of the region's own bindings, ``plan(model, family, state) -> [(module,
    forward factory, args)]``, every check run before anything is bound (``()``: the shared layer forwards
    of :mod:`rlalign_verl.align.forwards` carry it)."""
    check: Callable[[Any, Any], None] | None = None
    """``check(profile, spec)``: the region's request rules on the resolved profile (raise one line), run by
    :func:`~rlalign_verl.request.checks.validate_request` when the region is asked for."""
    check_model: Callable[[str, Any, Any, bool], None] | None = None
    """``check_model(model_type, config, spec, moe)``: its rules on the architecture, when the region is asked for."""
    startup: Callable[[Any, str], list[str]] | None = None
    """``startup(spec, regions_key)``: start-up warnings on a resolved request, whether or not the region is on
    (e.g. the rollout runs at TP > 1 without ``tp``)."""


REGISTRY: tuple[Region, ...] = (
    Region("rope", "RoPE's cos/sin table and rotation", True, "rope", ("attention",), rung=True),
    Region(
        "swiglu",
        "SiLU(gate) * up, dense MLPs and MoE experts",
        True,
        "swiglu",
        ("mlp",),
        rung=True,
        plan=("rlalign_verl.align.moe_patch:plan",),
    ),
    Region("rmsnorm", "residual add + RMSNorm", True, "norm", ("decoder_layer",), rung=True),
    Region(
        "moe",
        "MoE router and expert combine (refused on dense models)",
        False,
        "moe",
        plan=("rlalign_verl.align.moe_patch:plan",),
    ),
    Region(
        "attention",
        "the engine's attention op (vLLM CPU profiles)",
        False,
        None,
        ("attention",),
        shows="experimental.attention",
    ),
    Region(
        "lm_head",
        "the engine's head dtype",
        False,
        None,
        shows="experimental.head_dtype",
        plan=("rlalign_verl.align.regions.lm_head:plan",),
    ),
    Region(
        "tp",
        "the rollout's tensor-parallel reduction in o_proj/down_proj",
        False,
        None,  # the engine's all-reduce, keyed by engine and device: profiles_tp.reduction(profile)
        rung=True,
        shows="rollout_tp",
        only_tp=True,
        plan=("rlalign_verl.align.regions.tp:plan",),  # row-parallel projections; MoE experts and blocks too
        check=profiles_tp.check_request,
        check_model=profiles_tp.check_model,
        startup=profiles_tp.startup_lines,
    ),
)
BY_NAME: dict[str, Region] = {r.name: r for r in REGISTRY}

REGIONS: tuple[str, ...] = tuple(r.name for r in REGISTRY if r.in_all)
OPT_IN_REGIONS: tuple[str, ...] = tuple(r.name for r in REGISTRY if not r.in_all)


def normalize_regions(regions: Iterable[str] | str | None) -> tuple[str, ...]:
    """Validate region names and return them deduplicated in registry order.

    Accepts a sequence, a comma-separated string, ``"all"``/``"none"``, or ``None`` (= none).
    """
    if regions is None:
        return ()
    if isinstance(regions, str):
        items = [r for r in regions.replace(" ", "").split(",") if r]
        if not items:  # '' / ',' would turn alignment off without a word (an unset shell variable, a typo)
            raise ConfigFormatError(
                f"{key_name('regions').rstrip('=')}={regions!r} names no region; give region names (e.g. rope,swiglu,"
                "rmsnorm), or turn alignment off explicitly (verl: alignment.regions=[]; OpenRLHF: "
                "--alignment.regions none; Python: regions=())"
            )
    elif isinstance(regions, Iterable) and not isinstance(regions, Mapping | bytes):
        items = list(regions)
        odd = [r for r in items if not isinstance(r, str)]
        if odd:  # str(None) would read as "none" and turn alignment off without a word
            raise ConfigFormatError(
                f"regions={list(items)!r} holds {odd[0]!r}, not a region name; give names, e.g. "
                "alignment.regions=[rope,swiglu,rmsnorm], or [] to turn alignment off"
            )
        items = [r.strip() for r in items]
    else:
        raise ConfigFormatError(
            f"regions={regions!r} is a {type(regions).__name__}, not a list of region names; give e.g. "
            f"alignment.regions=[rope,swiglu,rmsnorm] (OpenRLHF: --alignment.regions rope,swiglu,rmsnorm)"
        )
    names = {r.lower() for r in items}
    if names == {"all"}:
        return REGIONS
    if names <= {"none"}:
        return ()
    if "all" in names:  # "all" plus an opt-in region, e.g. all,moe
        names = (names - {"all"}) | set(REGIONS)
    unknown = sorted(names - set(BY_NAME))
    if unknown:
        raise UnknownRegionError(
            f"unknown alignment region(s) {unknown}; valid regions: {list(BY_NAME)} "
            f"(e.g. alignment.regions=[rope] or [rope,swiglu,rmsnorm])"
        )
    return tuple(r.name for r in REGISTRY if r.name in names)


def ladder_rungs(regions: tuple[str, ...], rollout_tp: int) -> list[str]:
    """The verify passes for ``regions``: ``none``, and each aligned rung region alone when more than one is aligned
    (a region that changes nothing at ``rollout_tp`` would repeat the ``none`` pass)."""
    return ["none"] + [
        r.name
        for r in REGISTRY
        if r.rung and r.name in regions and len(regions) > 1 and not (r.only_tp and rollout_tp == 1)
    ]


def shown_settings(regions: Iterable[str]) -> tuple[str, ...]:
    """The request settings (dotted) that describe an alignment of ``regions``, in registry order."""
    wanted = set(regions)
    return tuple(r.shows for r in REGISTRY if r.name in wanted and r.shows)


def wrapped_roles(regions: Iterable[str]) -> tuple[str, ...]:
    """The family roles whose forwards ``regions`` replace (what ``get_alignment`` checks are still in place)."""
    return tuple(dict.fromkeys(role for r in regions for role in BY_NAME[r].wraps))


def plans(regions: Iterable[str]) -> tuple[str, ...]:
    """The binding planners ``regions`` need, each once, in registry order."""
    wanted = set(regions)
    return tuple(dict.fromkeys(p for r in REGISTRY if r.name in wanted for p in r.plan))


def region_hooks(regions: Iterable[str], hook: str) -> list[Callable]:
    """The ``hook`` (``check`` or ``check_model``) of each region in ``regions`` that has one, in registry order."""
    wanted = set(regions)
    return [getattr(r, hook) for r in REGISTRY if r.name in wanted and getattr(r, hook) is not None]


def startup_lines(spec: Any, regions_key: str = "alignment.regions") -> list[str]:
    """Every region's start-up warnings for a resolved request (verl driver, OpenRLHF launcher)."""
    return [line for r in REGISTRY if r.startup for line in r.startup(spec, regions_key)]
