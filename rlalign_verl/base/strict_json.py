"""JSON read as users mean it: a key given twice in one object is an error, not silently the last value."""

from __future__ import annotations

import json
from typing import Any


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class DuplicateKeyError(json.JSONDecodeError):
    """An object names ``key`` twice (a :class:`json.JSONDecodeError`, so a caller's malformed-JSON path holds)."""

    def __init__(self, key: str, doc: str, pos: int) -> None:
        super().__init__(f"duplicate key {key!r} (each key may appear once per object)", doc, pos)
        self.key = key


def loads(text: str | bytes) -> Any:
    """``json.loads`` that raises :class:`DuplicateKeyError` (at the key's second occurrence, where it is spelled
    plainly) where an object names a key twice: a parser would keep one of the two values without a word."""
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKey as dup:
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        quoted = json.dumps(dup.key)
        pos = doc.find(quoted, doc.find(quoted) + 1)
        raise DuplicateKeyError(dup.key, doc, max(pos, 0)) from None
