"""One ``head_dtype`` for both sides: the rollout engine's lm_head and the trainer's ``lm_head`` region.

The engine's head dtype lives in the rollout config (vLLM: ``actor_rollout_ref.rollout.engine_kwargs.vllm.
hf_overrides.head_dtype``, which verl passes to ``vllm.LLM``; SGLang: ``engine_kwargs.sglang.
enable_fp32_lm_head``) or in the checkpoint's ``config.json`` (``head_dtype``). With ``lm_head`` in
``alignment.regions`` the trainer computes its logits as that head does (:mod:`rlalign_verl.regions.lm_head`):

* engine head unset -> set it to ``alignment.head_dtype`` (default ``float32``): one flag, both sides;
* engine head set and equal -> kept; set and different -> refused, as is an engine fp32 head while the
  trainer keeps its bf16 head (alignment on without ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from ..options import parse_bool

HEAD_DTYPE_KEY = "rlalign_head_dtype"
"""HF-config attribute (via ``model.override_config``) carrying the trainer's head dtype to the workers."""
ATTENTION_KEY = "rlalign_attention"
"""HF-config attribute carrying ``alignment.attention`` (the attention region's variant) to the workers."""
UNVERIFIED_KEY = "rlalign_unverified"
"""HF-config attribute carrying ``alignment.unverified`` (opted-in unverified profile data) to the workers."""
COMPILED_NORM_KEY = "rlalign_compiled_norm"
"""HF-config attribute carrying ``alignment.compiled_norm`` (set only when true) to the workers."""
MOE_VARIANT_KEY = "rlalign_moe_variant"
"""HF-config attribute carrying ``alignment.moe_variant`` (set only when not ``emulate``) to the workers."""
VLLM_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides"
SGLANG_KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_fp32_lm_head"


def _select(config: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, throw_on_missing=False) if OmegaConf.is_config(config) else None


def engine_head_dtype(config: Any) -> tuple[str | None, str]:
    """``(head dtype the rollout engine will use or None if unset, where it is set)``."""
    from ..regions.lm_head import parse_head_dtype  # torch: import only when checking

    name = str(_select(config, "actor_rollout_ref.rollout.name") or "vllm")
    if name == "sglang":
        flag = _select(config, SGLANG_KEY)
        return (None if flag is None else ("float32" if flag else "model")), SGLANG_KEY
    overrides = _select(config, VLLM_KEY)
    value = None if overrides is None else overrides.get("head_dtype")
    if value is not None:
        return parse_head_dtype(value), f"{VLLM_KEY}.head_dtype"
    from .checks import local_config_json, read_config_json

    cfg_file = local_config_json(_select(config, "actor_rollout_ref.model.path") or "")
    value = read_config_json(cfg_file).get("head_dtype") if cfg_file else None
    return (None if value is None else parse_head_dtype(value)), "the checkpoint's config.json head_dtype"


def _set_engine_head(config: Any, head: str) -> None:
    from omegaconf import OmegaConf, open_dict

    name = str(_select(config, "actor_rollout_ref.rollout.name") or "vllm")
    with open_dict(config):
        if name == "sglang":
            OmegaConf.update(config, SGLANG_KEY, head == "float32", force_add=True)
        else:
            OmegaConf.update(config, f"{VLLM_KEY}.head_dtype", head, force_add=True)


def reconcile_head_dtype(config: Any, regions: tuple[str, ...]) -> str | None:
    """Check (and where unset, set) the rollout's head dtype against the trainer's; returns the trainer's.

    Returns None when alignment is off or ``lm_head`` is not aligned and the engine head is bf16.
    """
    if not regions:
        return None
    from ..regions.lm_head import HeadDtypeError, parse_head_dtype

    engine, where = engine_head_dtype(config)
    if "lm_head" not in regions:
        if engine == "float32":
            raise HeadDtypeError(
                f"the rollout engine computes fp32 logits ({where}) but the trainer's lm_head stays bf16: add lm_head "
                f"to alignment.regions (or remove the engine's fp32 head)"
            )
        return None
    trainer = parse_head_dtype(_select(config, "alignment.head_dtype"))
    if engine is None:
        if trainer == "float32":
            _set_engine_head(config, trainer)
        return trainer
    if engine != trainer:
        raise HeadDtypeError(
            f"alignment.head_dtype={trainer} but the rollout engine's head is {engine} ({where}); set both to the "
            f"same value (alignment.head_dtype or the engine setting), or drop lm_head from alignment.regions"
        )
    return trainer


def write_worker_options(
    config: Any, regions: tuple[str, ...], head: str | None, unverified: tuple[str, ...] = ()
) -> None:
    """Put the head dtype, the attention and MoE variants, the unverified opt-in and compiled_norm where the actor
    and ref read them."""
    from omegaconf import OmegaConf, open_dict

    from .config import OVERRIDE_PATH

    node = _select(config, OVERRIDE_PATH)
    if node is None or not OmegaConf.is_config(node):
        return
    with open_dict(node):
        node.pop(HEAD_DTYPE_KEY, None)
        node.pop(ATTENTION_KEY, None)
        node.pop(UNVERIFIED_KEY, None)
        if regions and unverified:
            node[UNVERIFIED_KEY] = list(unverified)
        node.pop(COMPILED_NORM_KEY, None)
        if "lm_head" in regions and head is not None:
            node[HEAD_DTYPE_KEY] = head
        if "attention" in regions:
            node[ATTENTION_KEY] = str(_select(config, "alignment.attention") or "engine-op")
        if parse_bool(_select(config, "alignment.compiled_norm") or False, name="alignment.compiled_norm"):
            node[COMPILED_NORM_KEY] = True
        node.pop(MOE_VARIANT_KEY, None)
        variant = str(_select(config, "alignment.moe_variant") or "emulate").strip().lower()
        if regions and variant != "emulate":  # validated on the driver (config.py) before this
            node[MOE_VARIANT_KEY] = variant
