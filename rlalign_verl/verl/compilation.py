"""Reading vLLM's ``compilation_config`` from a verl config: which region CustomOps run their kernels."""

from __future__ import annotations

from typing import Any

from rlalign_verl.base.errors import ConfigFormatError
from rlalign_verl.catalog.vllm_paths import compilation_mode
from rlalign_verl.verl.checks import json_setting


def plain(value: Any) -> Any:
    """OmegaConf containers to plain Python ones."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return value


CC_NAME = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"


def custom_ops_of(compilation_config: Any) -> list[str]:
    ops = json_setting(plain(compilation_config), name=CC_NAME).get("custom_ops") or []
    if isinstance(ops, str) or not isinstance(ops, list | tuple):
        raise ConfigFormatError(f'{CC_NAME}.custom_ops={ops!r} is not a list; give e.g. ["+rms_norm"]')
    return [str(op).strip() for op in ops]


def compile_disabled(compilation_config: Any) -> bool:
    """vLLM compilation mode/level 0 (NONE): no Inductor, every CustomOp runs its kernel."""
    cc = json_setting(plain(compilation_config), name=CC_NAME)
    try:
        return compilation_mode(cc) == "eager"
    except ValueError as err:
        raise ConfigFormatError(f"{CC_NAME}: {err}; give mode 0 (eager) or 3 (VLLM_COMPILE)") from None
