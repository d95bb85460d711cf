"""Replace a function attribute by a wrapper exactly once: the idiom every integration hook shares."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

WRAPPED = "_rlalign_wrapped"
"""Attribute set on every wrapper (tests and re-installs look for it)."""


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of our wrappers."""
    return bool(getattr(fn, WRAPPED, False))


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Set ``owner.name = make(original)`` (with ``functools.wraps`` and the marker).

    Returns False, changing nothing, when ``owner`` has no such attribute or it is already wrapped.
    """
    original = getattr(owner, name, None)
    if original is None or is_wrapped(original):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, WRAPPED, True)
    setattr(owner, name, wrapper)
    return True
