"""rlalign-verl: align the training stack's BF16 rounding to the inference engine's.

Import-light on purpose (the verl plugin imports this package inside inference servers): the
public names below are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "AlignmentSpec": "rlalign_verl.request.spec",
    "apply_alignment": "rlalign_verl.align.patch",
    "remove_alignment": "rlalign_verl.align.patch",
    "aligned": "rlalign_verl.align.patch",
    "get_alignment": "rlalign_verl.align.patch",
    "AlignmentState": "rlalign_verl.align.patch",
    "get_profile": "rlalign_verl.catalog.profiles",
    "PROFILES": "rlalign_verl.catalog.profiles",
    "EngineProfile": "rlalign_verl.catalog.profiles",
    "REGIONS": "rlalign_verl.request.regions",
    "normalize_regions": "rlalign_verl.request.regions",
    "SUPPORTED_MODEL_TYPES": "rlalign_verl.catalog.families",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlalign_verl' has no attribute {name!r}")
