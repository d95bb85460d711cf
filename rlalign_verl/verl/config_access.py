"""Reading a verl config: one accessor for OmegaConf nodes and plain mappings alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def select(config: Any, key: str, default: Any = None) -> Any:
    """``OmegaConf.select`` that also accepts plain dicts and treats ``???`` as missing."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.select(config, key, default=default, throw_on_missing=False)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra/verl
        pass
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return default if node == "???" else node
