"""The one way this package wraps a library's function or method (verl, OpenRLHF, vLLM): exactly once, undoably.

(Model instances are aligned by binding forwards on the instances: :mod:`rlalign_verl.align.binding`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

WRAPPED = "_rlalign_wrapped"
"""Attribute set on every wrapper (tests and re-installs look for it)."""
ORIGINAL = "__rlalign_original__"
"""Attribute of every wrapper: the function it wraps."""

_GROUPS: dict[str, list[tuple[Any, str, Any, bool]]] = {}
"""group -> ``(owner, name, original, owner had its own attribute)`` for each wrapper :func:`unwrap` restores."""


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of our wrappers."""
    return bool(getattr(fn, WRAPPED, False))


def wrap_once(
    owner: Any, name: str, make: Callable[[Callable], Callable], *, group: str | None = None
) -> bool:
    """Set ``owner.name = make(original)`` (with ``functools.wraps`` and the markers).

    Returns False, changing nothing, when ``owner`` has no such attribute or it is already wrapped. ``group``:
    remember the original so that :func:`unwrap` (group) restores it, also when the attribute holds a wrapper
    another install made (a module that bound the wrapped function at its import).
    """
    original = getattr(owner, name, None)
    if original is None:
        return False
    recorded = _GROUPS.setdefault(group, []) if group is not None else None
    if recorded is not None and any(r[0] is owner and r[1] == name for r in recorded):
        return False
    own = name in vars(owner) if hasattr(owner, "__dict__") else True
    if is_wrapped(original):
        if recorded is not None:
            recorded.append((owner, name, getattr(original, ORIGINAL, original), own))
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, WRAPPED, True)
    setattr(wrapper, ORIGINAL, original)
    setattr(owner, name, wrapper)
    if recorded is not None:
        recorded.append((owner, name, original, own))
    return True


def unwrap(group: str) -> bool:
    """Restore every attribute :func:`wrap_once` wrapped (or recorded) for ``group``; False when none."""
    recorded = _GROUPS.pop(group, [])
    for owner, name, original, own in reversed(recorded):
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    return bool(recorded)
