"""The engine's lm_head dtype in ``diagnose``: ``--engine-head-dtype``, the dump's record, the checkpoint.

vLLM runs its head in ``model_config.head_dtype`` (``hf_overrides={"head_dtype": "float32"}`` or a
``head_dtype`` in the checkpoint's ``config.json``; ``LogitsProcessor._apply_head``). The engine job passes
the option as ``hf_overrides`` and records it in the dump header (``extra.hf_overrides``), so a dump says
which head produced its log-probs. The ``lm_head`` region is then aligned to that dtype.
"""

from __future__ import annotations

from typing import Any

from rlalign_verl.base.errors import AlignmentError

FLAG = "--engine-head-dtype"


def check_head_option(value: str) -> str:
    """Canonical ``"float32"`` or ``"model"`` for ``--engine-head-dtype``; one-line error otherwise."""
    from rlalign_verl.request.checks import parse_head_dtype

    return parse_head_dtype(
        value,
        f"{FLAG} {value!r}",
        f"use {FLAG} float32 (the engine's fp32 lm_head, vLLM hf_overrides head_dtype) or {FLAG} model (the bf16 head)",
    )


def engine_hf_overrides(option: str | None) -> dict[str, Any]:
    """The ``hf_overrides`` the engine job gets for ``--engine-head-dtype`` (none for the model dtype)."""
    if option is not None and check_head_option(option) == "float32":
        return {"head_dtype": "float32"}
    return {}


def sample_head_dtype(header: Any, config: Any, option: str | None, source: str) -> tuple[str, str]:
    """``(head dtype, where it was read)`` of the engine that produced the rollouts.

    A dump's recorded ``hf_overrides.head_dtype`` wins; an option that contradicts it is refused. Without
    a record: the option, else the checkpoint's ``head_dtype``, else the model dtype.
    """
    recorded = ((header.extra or {}).get("hf_overrides") or {}).get("head_dtype")
    if recorded is not None:
        head = check_head_option(recorded)
        if option is not None and check_head_option(option) != head:
            raise AlignmentError(
                f"{FLAG} {option} but the rollouts were generated with head_dtype {head} ({source} header "
                f"hf_overrides); drop {FLAG} (the dump records the engine's head)"
            )
        return head, f"{source} header hf_overrides.head_dtype"
    if option is not None:
        return check_head_option(option), FLAG
    in_config = getattr(config, "head_dtype", None)
    if in_config is not None:
        return check_head_option(str(in_config)), "the checkpoint's config.json head_dtype"
    return "model", "default (no head_dtype override: the engine's head runs in the model dtype)"
