"""The facts the verl driver checks before Ray starts (:mod:`rlalign_verl.verl.config`), read from OpenRLHF's flags.

With regions on, the launcher refuses in one line naming the OpenRLHF flag, before Ray starts:

- the actor checkpoint (``--actor.model_name_or_path``, older ``--pretrain``): unset; a local-looking path
  (``/``, ``~``, ``./``, ``../``) that does not exist or holds no ``config.json``; a ``config.json`` that is not
  a JSON object or names no ``model_type``. A hub id is read with ``AutoConfig`` like on verl's driver (a failure is a warning: the workers
  check the built model again);
- its ``model_type`` and config against the regions, by the shared
  :func:`~rlalign_verl.request.checks.check_model` (unsupported family, MoE-only regions on a dense model,
  activation, router, expert parallel, TP with the moe region);
- dtypes: ``--ds.param_dtype`` (:func:`~rlalign_verl.request.checks.check_param_dtype`) and the engine's head,
  which vLLM reads from ``config.json``'s ``head_dtype`` (fp32 logits need the lm_head region, refused with OpenRLHF);
- the rollout's TP size, ``--vllm.tensor_parallel_size``, read as OpenRLHF's parser reads it (``int(value)``,
  last occurrence wins) and refused unless >= 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from rlalign_verl.base.errors import AlignmentError, ConfigFormatError, UnsupportedModelError
from rlalign_verl.base.options import spelled_as
from rlalign_verl.catalog.profiles import EngineProfile
from rlalign_verl.openrlhf.flags import installed_flags, last_given, spellings
from rlalign_verl.openrlhf.log import logger
from rlalign_verl.request.checkpoint import checkpoint_config
from rlalign_verl.request.checks import check_model, check_param_dtype, parse_head_dtype
from rlalign_verl.request.spec import AlignmentSpec

PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""``--ds.param_dtype`` values (OpenRLHF's choices) as torch dtype names."""


def last_flag(argv: Sequence[str], names: Sequence[str]) -> tuple[str, str] | None:
    """:func:`~rlalign_verl.openrlhf.flags.last_given` for a flag that takes a value: given bare, its value is
    ``""`` (refused by each reader)."""
    given = last_given(argv, names)
    return None if given is None else (given[0], "" if given[1] is True else given[1])


def flag_name(setting: str) -> str:
    """The spelling of ``setting`` the installed OpenRLHF declares (the newest when unknown)."""
    names = spellings(setting)
    known = installed_flags() or set()
    return next((n for n in names if n in known), names[0])


def rollout_tp(argv: Sequence[str]) -> int:
    """The vLLM engines' TP size as OpenRLHF's parser reads it (``type=int``, default 1); not >= 1: refused."""
    given = last_flag(argv, spellings("vllm_tensor_parallel_size"))
    if given is None:
        return 1
    flag, value = given
    try:
        tp = int(value)
    except ValueError:
        tp = 0
    if tp < 1:
        raise ConfigFormatError(
            f"{flag} {value!r} is not a tensor-parallel size OpenRLHF runs: give an integer >= 1, e.g. {flag} 2"
        )
    return tp


def check_param_dtype_flag(argv: Sequence[str]) -> None:
    """``--ds.param_dtype``: the trainer's dtype (OpenRLHF's default bf16) must be one the profiles mirror."""
    given = last_flag(argv, spellings("param_dtype"))
    if given is None:
        return
    flag, value = given
    dtype = PARAM_DTYPES.get(value)
    if dtype is None:
        raise ConfigFormatError(
            f"{flag} {value!r}: OpenRLHF takes {' or '.join(PARAM_DTYPES)}; use {flag} bf16"
        )
    try:
        check_param_dtype(dtype)
    except UnsupportedModelError:
        raise UnsupportedModelError(
            f"{flag} {value} builds the actor in {dtype}, but every engine profile mirrors bf16 rounding (fp16 "
            f"engines are not verified) and OpenRLHF's vLLM runs bfloat16; use {flag} bf16 (the default) or turn "
            "alignment off (--alignment.regions none)"
        ) from None


def checkpoint_facts(argv: Sequence[str]) -> tuple[str, str, str | None, Any]:
    """``(flag, path, model_type, config.json as attributes)`` of the actor checkpoint in OpenRLHF's flags.

    The config is ``None`` for a hub id (and ``model_type`` too when ``AutoConfig`` cannot read it).
    """
    given = last_flag(argv, spellings("model_path"))
    if given is None or not given[1].strip():
        flag = given[0] if given else flag_name("model_path")
        raise AlignmentError(
            f"{flag} is not set: set it to the checkpoint (folder or hub id) the actor loads, or turn alignment "
            "off (--alignment.regions none)"
        )
    flag, path = given
    model_type, data = checkpoint_config(
        path,
        flag,
        missing_fix="set it to the checkpoint folder the actors load (a folder only the worker nodes hold: put a "
        "copy of its config.json at that path here)",
        log=logger,
        machine="the launcher's machine",
    )
    return flag, path, model_type, (None if data is None else SimpleNamespace(**data))


def check_engine_head(config: Any, flag: str) -> None:
    """vLLM reads ``head_dtype`` from ``config.json``: fp32 logits there need the lm_head region (not OpenRLHF's)."""
    value = getattr(config, "head_dtype", None)
    if value is None:
        return
    where = f"head_dtype={value!r} in the config.json of {flag}"
    head = parse_head_dtype(value, where, "remove it (vLLM then computes the head in the model dtype)")
    if head == "float32":
        raise AlignmentError(
            f"{where}: OpenRLHF's vLLM engines compute fp32 logits but the trainer's lm_head stays bf16 (the launcher "
            "cannot align lm_head); remove head_dtype from that config.json, or turn alignment off"
        )


def check_checkpoint(
    spec: AlignmentSpec, profile: EngineProfile, argv: Sequence[str], expert_parallel: Any = None
) -> None:
    """Everything the verl driver checks on the checkpoint and dtypes, for an aligned launch (regions on)."""
    check_param_dtype_flag(argv)
    flag, path, model_type, config = checkpoint_facts(argv)
    if config is not None:
        check_engine_head(config, flag)
    if model_type is None:
        return
    try:
        with spelled_as("flag"):
            check_model(spec, profile, model_type, config, expert_parallel)
    except AlignmentError as err:  # the shared check's line, saying which flag gave the model
        raise type(err)(f"{flag} {path}: {err}") from None
