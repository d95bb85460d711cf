"""Reading one value of an alignment request: choices, integers, name lists; the one-line error for a bad one
(region names: :mod:`rlalign_verl.request.regions`).

The helpers of :meth:`rlalign_verl.request.spec.AlignmentSpec.parse`; each error names the key as the user wrote it
(as the current surface writes it: :func:`rlalign_verl.base.options.surface`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rlalign_verl.base.errors import ConfigFormatError
from rlalign_verl.base.options import key_name, surface


def bad_value(dotted: str, value: Any, want: str) -> ConfigFormatError:
    python = surface() == "python"
    shown = value if isinstance(value, str) and not python else repr(value)  # as typed on the line
    sep = "" if python else "="
    return ConfigFormatError(f"{key_name(dotted)}{sep}{shown}: {want}")


def choice(value: Any, options: Iterable[str], dotted: str, aliases: Mapping | None = None) -> str:
    text = str(value).strip().lower()
    table = dict(aliases or {o: o for o in options})
    if text not in table:
        raise bad_value(dotted, value, f"use one of {', '.join(options)}")
    return table[text]


def integer(value: Any, dotted: str, minimum: int, why: str = "") -> int:
    """``value`` as an int >= ``minimum`` (a numeric string too); ``why``: the reason for the minimum, said."""
    fix = f"give an integer >= {minimum}" + (f": {why}" if why else "")
    if isinstance(value, bool):
        raise bad_value(dotted, value, fix)
    try:
        number = int(str(value).strip()) if isinstance(value, str) else value
    except ValueError:
        raise bad_value(dotted, value, fix) from None
    if not isinstance(number, int) or number < minimum:
        raise bad_value(dotted, value, fix)
    return number


def names(value: Any, valid: tuple[str, ...], dotted: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, Iterable) and not isinstance(value, Mapping | bytes):
        items = list(value)
        if not all(isinstance(v, str) for v in items):  # str(None) would read as "none": silently nothing
            raise bad_value(dotted, value, f"give names: {', '.join(valid)} (or empty)")
    else:
        raise bad_value(dotted, value, f"give a list of {', '.join(valid)} (or empty)")
    names = {v.strip().lower() for v in items} - {"", "none"}
    unknown = sorted(names - set(valid))
    if unknown:
        raise bad_value(dotted, value, f"unknown {unknown}; valid: {', '.join(valid)} (or empty)")
    return tuple(sorted(names))
