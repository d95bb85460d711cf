"""One ``head_dtype`` for both sides: the rollout engine's lm_head and the trainer's ``lm_head`` region.

The engine's head dtype lives in the rollout config (vLLM: ``actor_rollout_ref.rollout.engine_kwargs.vllm.
hf_overrides.head_dtype``, which verl passes to ``vllm.LLM``; SGLang: ``engine_kwargs.sglang.
enable_fp32_lm_head``) or in the checkpoint's ``config.json`` (``head_dtype``). With ``lm_head`` in
``alignment.regions`` the trainer computes its logits as that head does (:mod:`rlalign_verl.align.regions.lm_head`):

* engine head unset -> set it to ``alignment.experimental.head_dtype`` (default ``float32``): one flag, both sides;
* engine head set and equal -> kept; set and different -> refused, as is an engine fp32 head while the
  trainer keeps its bf16 head (alignment on without ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from rlalign_verl.request.checks import HeadDtypeError, parse_head_dtype
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.verl.config_access import select as _select

VLLM_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"
SGLANG_KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_fp32_lm_head"


def _head(value: Any, where: str) -> str:
    return parse_head_dtype(value, f"{where}={value!r}", "use float32 (fp32 logits) or the model dtype")


def engine_head_dtype(config: Any) -> tuple[str | None, str]:
    """``(head dtype the rollout engine will use or None if unset, where it is set)``."""
    name = str(_select(config, "actor_rollout_ref.rollout.name") or "vllm")
    if name == "sglang":
        flag = _select(config, SGLANG_KEY)
        return (None if flag is None else ("float32" if flag else "model")), SGLANG_KEY
    overrides = _select(config, VLLM_KEY)
    value = None if overrides is None else overrides.get("head_dtype")
    if value is not None:
        return _head(value, f"{VLLM_KEY}.head_dtype"), f"{VLLM_KEY}.head_dtype"
    from rlalign_verl.request.checkpoint import config_file, read_config

    key = "actor_rollout_ref.model.path"
    cfg_file = config_file(_select(config, key) or "")
    value = read_config(cfg_file, key).get("head_dtype") if cfg_file else None
    where = "the checkpoint's config.json head_dtype"
    return (None if value is None else _head(value, where)), where


def _set_engine_head(config: Any, head: str) -> None:
    from omegaconf import OmegaConf, open_dict

    name = str(_select(config, "actor_rollout_ref.rollout.name") or "vllm")
    with open_dict(config):
        if name == "sglang":
            OmegaConf.update(config, SGLANG_KEY, head == "float32", force_add=True)
        else:
            OmegaConf.update(config, f"{VLLM_KEY}.head_dtype", head, force_add=True)


def reconcile_head_dtype(config: Any, spec: AlignmentSpec | None) -> str | None:
    """Check (and where unset, set) the rollout's head dtype against the trainer's; returns the trainer's.

    Returns None when alignment is off or ``lm_head`` is not aligned and the engine head is bf16.
    """
    if spec is None or not spec.regions:
        return None
    engine, where = engine_head_dtype(config)
    if "lm_head" not in spec.regions:
        if engine == "float32":
            raise HeadDtypeError(
                f"the rollout engine computes fp32 logits ({where}) but the trainer's lm_head stays bf16: add lm_head "
                f"to alignment.regions (or remove the engine's fp32 head)"
            )
        return None
    trainer = spec.experimental.head_dtype
    if engine is None:
        if trainer == "float32":
            _set_engine_head(config, trainer)
        return trainer
    if engine != trainer:
        raise HeadDtypeError(
            f"alignment.experimental.head_dtype={trainer} but the rollout engine's head is {engine} ({where}); set "
            f"both to the same value, or drop lm_head from alignment.regions"
        )
    return trainer
