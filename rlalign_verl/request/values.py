"""Reading one value of an alignment request: choices, integers, name lists; the one-line error for a bad one
(region names: :mod:`rlalign_verl.request.regions`).

The helpers of :meth:`rlalign_verl.request.spec.AlignmentSpec.parse`; each error names the key as the user wrote it
(as the current surface writes it: :func:`rlalign_verl.base.options.surface`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from rlalign_verl.base import strict_json
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


def decode_spec(text: str) -> Any:
    """A spec's JSON text, decoded strictly (a key given twice is refused, not read as its last value)."""
    try:
        return strict_json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigFormatError(
            f"alignment spec is not valid JSON ({err.msg}); give a JSON object such as "
            '{"regions": ["rope"], "engine": "vllm"} (a spec a driver wrote: re-run the driver)'
        ) from None


def given(section: Mapping, name: str, default: str) -> Any:
    """A choice's value as given; only a missing (``None``) one takes the default (``''`` is a bad value)."""
    value = section.get(name)
    return default if value is None else value


def plain(value: Any) -> Any:
    """OmegaConf containers (and dataclasses) to plain Python values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl/hydra
        pass
    return value


_EXAMPLE_KEY = {"verify": "every", "doctor": "enable", "experimental": "compile"}


def section(data: Mapping, name: str) -> dict:
    node = plain(data.get(name))
    if node is None:
        return {}
    if isinstance(node, str) and name == "verify" and node.strip().lower() in ("off", "false", "on", "true"):
        return {"enable": node}  # alignment.verify=off
    if isinstance(node, bool) and name in ("verify", "doctor"):
        return {"enable": node}
    if isinstance(node, str) and name == "doctor" and node.strip().lower() in ("off", "false", "on", "true"):
        return {"enable": node}  # alignment.doctor=off
    if not isinstance(node, Mapping):
        raise bad_value(
            name,
            node,
            f"give a mapping of {name} keys, e.g. {key_name(name + '.' + _EXAMPLE_KEY[name])}",
        )
    return dict(node)
