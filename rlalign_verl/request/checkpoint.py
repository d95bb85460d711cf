"""The actor checkpoint's ``config.json``, read where a run starts (verl's driver, OpenRLHF's launcher) before anything
expensive: one rule for both, each refusal one line naming the user's key or flag (``key``).

A local-looking path (``/``, ``~``, ``./``, ``../``) must exist and hold a ``config.json`` (or be that JSON file,
which transformers' ``AutoConfig.from_pretrained`` also reads); the file must be a JSON object, each key once,
naming its ``model_type``. Anything else is a hub id, read through ``AutoConfig`` (no network: a failure is a
warning, and the workers check the built model again).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from rlalign_verl.base import strict_json
from rlalign_verl.base.errors import AlignmentError, ConfigFormatError

LOCAL_PREFIXES = ("/", "~", "./", "../")
"""How a local path starts; anything else may be a hub id."""
logger = logging.getLogger("rlalign_verl")


def config_file(path: Any, *, file_ok: bool = False) -> str | None:
    """``<path>/config.json`` when ``path`` is a local directory holding one, ``path`` itself when ``file_ok`` (a key
    naming the config, not the checkpoint: verl's ``hf_config_path``) and it is a local JSON file, else ``None``."""
    local = os.path.expanduser(str(path))
    if file_ok and os.path.isfile(local) and local.endswith(".json"):
        return local
    cfg = os.path.join(local, "config.json")
    return cfg if os.path.isfile(cfg) else None


def read_config(cfg_file: str, key: str) -> dict:
    """The JSON object in ``cfg_file``; a one-line error naming ``key`` (where the path was given) when it is
    unreadable, not JSON, names a key twice or is not an object."""
    try:
        with open(cfg_file, encoding="utf-8") as f:
            data = strict_json.loads(f.read())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFormatError(
            f"cannot read {cfg_file} ({type(err).__name__}: {err}); check {key}"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigFormatError(
            f"{cfg_file} is not valid JSON ({err.msg}, line {err.lineno} column {err.colno}; truncated?); re-save "
            f"the checkpoint or point {key} at a complete one"
        ) from None
    if not isinstance(data, dict):
        raise ConfigFormatError(
            f"{cfg_file} holds a JSON {type(data).__name__}, not an object with model_type; point {key} at a "
            "Hugging Face checkpoint directory"
        )
    return data


def checkpoint_config(
    path: Any,
    key: str,
    *,
    missing_fix: str,
    trust_remote_code: bool = False,
    sep: str = " ",
    file_ok: bool = False,
    log: logging.Logger = logger,
    machine: str = "this machine",
) -> tuple[str | None, dict | None]:
    """``(model_type, config.json)`` of the checkpoint at ``path`` (given as ``key``); the config is ``None`` for a
    hub id, and ``model_type`` too when ``AutoConfig`` cannot read it here. ``missing_fix``: what to do when a
    local path does not exist or holds no ``config.json`` (each surface has its own way to point at a copy). ``sep``:
    between the key and the path as the surface writes them (``=`` for a Hydra key, a space for a flag);
    ``file_ok``: as :func:`config_file`; ``log``: where a hub id that cannot be read here is said (the surface's
    visible logger); ``machine``: where the path was looked for, as the surface says it (``the driver``)."""
    text = str(path or "").strip()
    if not text:
        raise AlignmentError(f"{key} is not set: set it to the checkpoint (folder or hub id) the actor loads")
    cfg = config_file(text, file_ok=file_ok)
    if cfg is not None:
        data = read_config(cfg, key)
        model_type = data.get("model_type")
        if not isinstance(model_type, str) or not model_type.strip():
            raise AlignmentError(
                f"{cfg} ({key}) names no model_type ({model_type!r}), so neither the alignment checks nor the "
                "workers' AutoConfig can tell its architecture; use the checkpoint's own config.json"
            )
        return model_type, data
    if text.startswith(LOCAL_PREFIXES):
        local = os.path.expanduser(text)
        what = (
            "does not exist"
            if not os.path.exists(local)
            else "is a file, not a checkpoint folder"
            if os.path.isfile(local)
            else "holds no config.json"
        )
        raise AlignmentError(f"{key}{sep}{text} {what} on {machine}; {missing_fix}")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(text, trust_remote_code=trust_remote_code).model_type, None
    except Exception as err:  # noqa: BLE001 - any loader failure: the workers check the built model again
        log.warning(
            "cannot read the model config of %s here (%s: %s); the model type is checked when the workers build "
            "the model",
            text,
            type(err).__name__,
            err,
        )
        return None, None
