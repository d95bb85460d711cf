"""Reading vLLM's ``compilation_config`` from a verl config: which region CustomOps run their kernels."""

from __future__ import annotations

from typing import Any

from rlalign_verl.base.errors import ConfigFormatError
from rlalign_verl.verl.checks import json_setting

# The CustomOp names whose CUDA/C++ kernels replace the three regions' native forwards in vLLM.
REGION_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding")


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
    mode = cc.get("mode", cc.get("level"))
    return mode is not None and str(mode).strip().upper() in ("0", "NONE", "NO_COMPILATION")


def kernels_on(custom_ops: list[str]) -> bool | None:
    """Whether the region ops run their custom kernels: True (all), False (none), None (some)."""
    enabled = set()
    if "all" in custom_ops:
        enabled = set(REGION_OPS)
    for op in custom_ops:
        name = op.lstrip("+-")
        if name in REGION_OPS:
            if op.startswith("+"):
                enabled.add(name)
            elif op.startswith("-"):
                enabled.discard(name)
    if not enabled:
        return False
    if enabled == set(REGION_OPS):
        return True
    return None
