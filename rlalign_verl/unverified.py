"""The opt-in into profile data that no recorded run has checked against the engine yet.

One option, three spellings that all end in the same tuple: ``apply_alignment(..., unverified=("moe",))``,
verl's ``alignment.unverified=[moe]`` and OpenRLHF's ``--alignment.unverified moe``. The drivers resolve it
and carry it to the workers with the other alignment settings; the environment variable
``RLALIGN_UNVERIFIED=moe`` is an equivalent spelling (added to the option wherever it is read).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import ConfigFormatError

UNVERIFIED_ENV = "RLALIGN_UNVERIFIED"
"""Comma list of unverified profile data the user opts into (same names as the option)."""
UNVERIFIED_NAMES = ("moe",)
"""``moe``: a profile's MoE rounding read from source but not yet run against the engine's ops."""
OPT_IN_HINT = (
    "opt in with alignment.unverified=[moe] (verl) / --alignment.unverified moe (OpenRLHF) / "
    f"apply_alignment(..., unverified=('moe',)) (or {UNVERIFIED_ENV}=moe)"
)


def parse_unverified(value: Iterable[str] | str | None, *, name: str = "unverified") -> tuple[str, ...]:
    """The opted-in names, sorted and deduplicated, from a comma list, an iterable or None (none).

    An unknown name raises ``ConfigFormatError`` (one line listing the valid names).
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    names = {v.strip().lower() for v in items} - {"", "none"}
    unknown = sorted(names - set(UNVERIFIED_NAMES))
    if unknown:
        raise ConfigFormatError(
            f"{name}: unknown value(s) {unknown}; valid: {', '.join(UNVERIFIED_NAMES)} (or empty for none)"
        )
    return tuple(sorted(names))


def resolve_unverified(value: Iterable[str] | str | None, *, name: str = "unverified") -> tuple[str, ...]:
    """:func:`parse_unverified` of ``value`` joined with the ``RLALIGN_UNVERIFIED`` spelling."""
    env = parse_unverified(os.environ.get(UNVERIFIED_ENV), name=UNVERIFIED_ENV)
    return tuple(sorted(set(parse_unverified(value, name=name)) | set(env)))
