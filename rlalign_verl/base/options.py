"""Strict parsing of option values that arrive as text (Hydra overrides, CLI flags, env vars)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from rlalign_verl.base.errors import ConfigFormatError

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def parse_bool(value: Any, *, name: str = "value") -> bool:
    """A bool from ``True/False``, ``0/1`` or ``true/false/yes/no/on/off/1/0`` (any case).

    Anything else raises ``ConfigFormatError`` naming ``name`` and a valid spelling: ``bool(str)`` would
    turn ``"false"`` and ``"off"`` into True.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
    raise ConfigFormatError(f"{name}={value!r} is not a boolean; use {name}=true or {name}=false")


def option_bool(value: Any, *, name: str, default: bool) -> bool:
    """:func:`parse_bool`, with ``None`` (unset) meaning ``default``."""
    return default if value is None else parse_bool(value, name=name)


SPELLINGS = ("hydra", "flag", "python")
"""How a key is named in messages: ``alignment.verify.every`` / ``--alignment.verify.every`` / ``every=``."""

_SURFACE: ContextVar[str] = ContextVar("rlalign_verl_surface", default="hydra")


@contextlib.contextmanager
def spelled_as(spelling: str) -> Iterator[None]:
    """Inside the block, messages name keys as ``spelling`` writes them. Set once, at a surface's edge (the
    verl driver, the OpenRLHF launcher and workers, the Python API); the checks below it never pass it on."""
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling={spelling!r}: use one of {', '.join(SPELLINGS)}")
    token = _SURFACE.set(spelling)
    try:
        yield
    finally:
        _SURFACE.reset(token)


def surface() -> str:
    """The spelling of the surface the current request came from (``hydra`` outside any :func:`spelled_as`)."""
    return _SURFACE.get()


def key_name(dotted: str, spelling: str | None = None) -> str:
    """``dotted`` (``verify.every``) as the user writes it on one surface (default: the current one)."""
    spelling = spelling or surface()
    if spelling == "flag":
        return f"--alignment.{dotted}"
    if spelling == "python":
        return f"{dotted.rsplit('.', 1)[-1]}="
    return f"alignment.{dotted}"


def key_setting(dotted: str, value: str, spelling: str | None = None) -> str:
    """``dotted`` set to ``value`` as the user writes it on one surface (``value`` in the Hydra spelling)."""
    spelling = spelling or surface()
    if spelling == "flag":
        return f"--alignment.{dotted} {value}"
    if spelling == "python":
        text = {"true": "True", "false": "False"}.get(value, repr(value))
        return f"{dotted.rsplit('.', 1)[-1]}={text}"
    return f"alignment.{dotted}={value}"
