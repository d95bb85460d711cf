"""Reading one value of an alignment request: choices, integers, name lists, region names; the one-line error
for a bad one.

The helpers of :meth:`rlalign_verl.request.spec.AlignmentSpec.parse`; each error names the key as the user wrote it
(``spelling``: ``hydra``, ``flag`` or ``python``, :func:`rlalign_verl.base.options.key_name`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlalign_verl.base.errors import ConfigFormatError, UnknownRegionError
from rlalign_verl.base.options import key_name


def bad_value(dotted: str, value: Any, want: str, spelling: str) -> ConfigFormatError:
    shown = value if isinstance(value, str) and spelling != "python" else repr(value)  # as typed on the line
    sep = "" if spelling == "python" else "="
    return ConfigFormatError(f"{key_name(dotted, spelling)}{sep}{shown}: {want}")


def choice(
    value: Any, options: Iterable[str], dotted: str, spelling: str, aliases: Mapping | None = None
) -> str:
    text = str(value).strip().lower()
    table = dict(aliases or {o: o for o in options})
    if text not in table:
        raise bad_value(dotted, value, f"use one of {', '.join(options)}", spelling)
    return table[text]


def integer(value: Any, dotted: str, spelling: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise bad_value(dotted, value, f"give an integer >= {minimum}", spelling)
    try:
        number = int(str(value).strip()) if isinstance(value, str) else value
    except ValueError:
        raise bad_value(dotted, value, f"give an integer >= {minimum}", spelling) from None
    if not isinstance(number, int) or number < minimum:
        raise bad_value(dotted, value, f"give an integer >= {minimum}", spelling)
    return number


def names(value: Any, valid: tuple[str, ...], dotted: str, spelling: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, Iterable) and not isinstance(value, Mapping | bytes):
        items = list(value)
        if not all(isinstance(v, str) for v in items):  # str(None) would read as "none": silently nothing
            raise bad_value(dotted, value, f"give names: {', '.join(valid)} (or empty)", spelling)
    else:
        raise bad_value(dotted, value, f"give a list of {', '.join(valid)} (or empty)", spelling)
    names = {v.strip().lower() for v in items} - {"", "none"}
    unknown = sorted(names - set(valid))
    if unknown:
        raise bad_value(dotted, value, f"unknown {unknown}; valid: {', '.join(valid)} (or empty)", spelling)
    return tuple(sorted(names))


# --- region names (the request's vocabulary; the math lives in rlalign_verl.align.regions) ---------------

REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
ALL_REGIONS = REGIONS
OPT_IN_REGIONS: tuple[str, ...] = ("moe", "attention", "lm_head", "tp")
"""Accepted by name only, never part of ``all``: ``moe`` (MoE router and combine; refused on dense models),
``attention`` (vLLM CPU profiles; :mod:`.attention`), ``lm_head`` (the engine's head dtype; :mod:`.lm_head`) and
``tp`` (the rollout's tensor-parallel reduction in o_proj/down_proj; :mod:`rlalign_verl.align.regions.tp`)."""


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
