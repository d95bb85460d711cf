"""Type and format checks of the verl-side inputs, each failing with one line that names the fix.

Run on the driver (from :mod:`rlalign_verl.verl.config`) before Ray or any engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlalign_verl.base import strict_json
from rlalign_verl.base.errors import ConfigFormatError

SEARCHPATH = "hydra.searchpath=[pkg://rlalign_verl.configs]"
"""The override that makes verl's own entry point find the ``alignment`` config group."""


def check_alignment_node(node: Any) -> None:
    """Raise unless the composed ``alignment`` node is a mapping (or absent).

    Without :data:`SEARCHPATH`, verl's entry point turns ``+alignment=all`` into the *string* ``"all"``:
    the group was never loaded, and the run would go on unaligned.
    """
    if node is None or isinstance(node, Mapping):
        return
    raise ConfigFormatError(
        f"alignment is {type(node).__name__} {node!r}, not the alignment group's mapping: with verl's entry "
        f"point add {SEARCHPATH} before +alignment=<name> (or use python -m rlalign_verl.main_ppo "
        f"alignment=<name>)"
    )


def json_setting(value: Any, *, name: str) -> dict:
    """A JSON-object setting given as a mapping, a JSON string or nothing; ``{}`` when empty."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = strict_json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigFormatError(
                f"{name} is not valid JSON ({err.msg} at char {err.pos}); give a JSON object, e.g. "
                f"{name}='{{\"mode\": 0}}', or a config mapping"
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigFormatError(
            f"{name} is a {type(value).__name__}, not a JSON object / mapping; give e.g. {name}='{{\"mode\": 0}}'"
        )
    return dict(value)


def check_override_spellings(argv: list[str]) -> None:
    """Refuse, naming the new key, a command-line override of an ``alignment`` key that moved under
    ``alignment.experimental`` (Hydra itself would only say the key is not in the struct)."""
    from rlalign_verl.request.spec import MOVED, key_name

    for arg in argv:
        name, eq, _ = arg.lstrip("+~").partition("=")
        if eq and name.startswith("alignment.") and name[len("alignment.") :] in MOVED:
            old = name[len("alignment.") :]
            raise ConfigFormatError(
                f"{key_name(old)} moved to {key_name(MOVED[old])}; rename it on the command line"
            )
