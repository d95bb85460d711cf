"""How the resolved alignment request travels from verl's driver to its workers: one key, one JSON value.

The driver writes ``AlignmentSpec.to_json()`` to ``actor_rollout_ref.model.override_config.rlalign_spec``;
verl's ``update_model_config`` sets it as an attribute of the actor's and ref's HF config (the critic has
its own model config and never gets it); the worker hook reads it back and strips it before the model is
saved.
"""

from __future__ import annotations

SPEC_KEY = "rlalign_spec"
"""The one ``model.override_config`` key (and HF-config attribute in the workers) carrying the resolved spec."""
OVERRIDE_PATH = "actor_rollout_ref.model.override_config"
OLD_KEYS = (
    "rlalign_regions",
    "rlalign_engine",
    "rlalign_compile",
    "rlalign_kernels",
    "rlalign_engine_auto",
    "rlalign_rollout",
    "rlalign_head_dtype",
    "rlalign_attention",
    "rlalign_unverified",
    "rlalign_compiled_norm",
    "rlalign_moe_variant",
)
"""HF-config attributes older releases carried the settings in (a saved checkpoint may still hold them)."""
