"""The three rounding regions. Each is a plain differentiable function parameterised by a profile."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import ConfigFormatError, UnknownRegionError

REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
ALL_REGIONS = REGIONS


def normalize_regions(regions: Iterable[str] | str | None) -> tuple[str, ...]:
    """Validate region names and return them deduplicated in canonical order.

    Accepts a sequence, a comma-separated string, ``"all"``/``"none"``, or ``None`` (= none).
    """
    if regions is None:
        return ()
    if isinstance(regions, str):
        items = [r for r in regions.replace(" ", "").split(",") if r]
    elif isinstance(regions, Iterable) and not isinstance(regions, Mapping | bytes):
        items = [str(r).strip() for r in regions]
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
    unknown = sorted(names - set(REGIONS))
    if unknown:
        raise UnknownRegionError(
            f"unknown alignment region(s) {unknown}; valid regions: {list(REGIONS)} "
            f"(e.g. alignment.regions=[rope] or [rope,swiglu,rmsnorm])"
        )
    return tuple(r for r in REGIONS if r in names)
