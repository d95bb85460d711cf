"""The three rounding regions. Each is a plain differentiable function parameterised by a profile."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import ConfigFormatError, UnknownRegionError

REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
ALL_REGIONS = REGIONS
OPT_IN_REGIONS: tuple[str, ...] = ("moe", "attention", "lm_head")
"""Accepted by name only, never part of ``all``: ``moe`` (MoE router and combine; refused on dense models),
``attention`` (vLLM CPU profiles; :mod:`.attention`) and ``lm_head`` (the engine's head dtype; :mod:`.lm_head`)."""


def normalize_regions(regions: Iterable[str] | str | None) -> tuple[str, ...]:
    """Validate region names and return them deduplicated in canonical order.

    Accepts a sequence, a comma-separated string, ``"all"``/``"none"``, or ``None`` (= none).
    """
    if regions is None:
        return ()
    if isinstance(regions, str):
        items = [r for r in regions.replace(" ", "").split(",") if r]
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
    unknown = sorted(names - set(REGIONS) - set(OPT_IN_REGIONS))
    if unknown:
        raise UnknownRegionError(
            f"unknown alignment region(s) {unknown}; valid regions: {list(REGIONS + OPT_IN_REGIONS)} "
            f"(e.g. alignment.regions=[rope] or [rope,swiglu,rmsnorm])"
        )
    return tuple(r for r in REGIONS + OPT_IN_REGIONS if r in names)
