"""Type and format checks of the verl-side inputs, each failing with one line that names the fix.

Run on the driver (from :mod:`rlalign_verl.verl.config`) before Ray or any engine starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..errors import AlignmentError, ConfigFormatError
from ..options import option_bool

SEARCHPATH = "hydra.searchpath=[pkg://rlalign_verl.configs]"
"""The override that makes verl's own entry point find the ``alignment`` config group."""


def check_alignment_node(node: Any) -> None:
    """Raise unless the composed ``alignment`` node is a mapping (or absent).

    Without :data:`SEARCHPATH`, verl's entry point turns ``+alignment=all`` into the *string* ``"all"``:
    the group was never loaded, and the run would go on unaligned.
    """
    if node is None or isinstance(node, Mapping):
        return
    raise ConfigFormatError(
        f"alignment is {type(node).__name__} {node!r}, not the alignment group's mapping: with verl's entry "
        f"point add {SEARCHPATH} before +alignment=<name> (or use python -m rlalign_verl.main_ppo "
        f"alignment=<name>)"
    )


def json_setting(value: Any, *, name: str) -> dict:
    """A JSON-object setting given as a mapping, a JSON string or nothing; ``{}`` when empty."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigFormatError(
                f"{name} is not valid JSON ({err.msg} at char {err.pos}); give a JSON object, e.g. "
                f"{name}='{{\"mode\": 0}}', or a config mapping"
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigFormatError(
            f"{name} is a {type(value).__name__}, not a JSON object / mapping; give e.g. {name}='{{\"mode\": 0}}'"
        )
    return dict(value)


def read_config_json(path: str) -> dict:
    """The JSON object in a checkpoint's ``config.json``; a one-line error when it is broken."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFormatError(
            f"cannot read {path} ({type(err).__name__}: {err}); check actor_rollout_ref.model.path"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigFormatError(
            f"{path} is not valid JSON ({err.msg}, line {err.lineno} column {err.colno}; truncated?); "
            f"re-save the checkpoint or point actor_rollout_ref.model.path at a complete one"
        ) from None
    if not isinstance(data, dict):
        raise ConfigFormatError(
            f"{path} holds a JSON {type(data).__name__}, not an object with model_type; point "
            f"actor_rollout_ref.model.path at a Hugging Face checkpoint directory"
        )
    return data


def local_config_json(path: Any) -> str | None:
    """``<path>/config.json`` when ``path`` is a local directory holding one, else None."""
    local = os.path.expanduser(str(path))
    cfg_file = os.path.join(local, "config.json")
    return cfg_file if os.path.isfile(cfg_file) else None


OPTIONAL_KEYS = ("metrics_quantiles",)
"""``alignment`` keys that are not in the group's ``default.yaml`` (set with ``+alignment.<key>=...``)."""


def alignment_keys() -> set[str]:
    """The keys the ``alignment`` group defines (read from its ``default.yaml``) plus :data:`OPTIONAL_KEYS`."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    default = OmegaConf.load(str(files("rlalign_verl.configs").joinpath("alignment", "default.yaml")))
    return set(default.alignment) | set(OPTIONAL_KEYS)


def check_alignment_keys(node: Mapping) -> None:
    """Refuse a key the plugin does not read (``+alignment.compiled=true`` would be silently ignored)."""
    known = alignment_keys()
    unknown = sorted(str(k) for k in node if str(k) not in known)
    if not unknown:
        return
    import difflib

    hints = [f"alignment.{m[0]}" for k in unknown if (m := difflib.get_close_matches(k, known, n=1))]
    hint = f"did you mean {', '.join(hints)}? " if hints else ""
    raise ConfigFormatError(
        f"unknown alignment key(s) {unknown}; {hint}valid keys: {', '.join(sorted(known))}"
    )


EP_KEY = "actor_rollout_ref.rollout.expert_parallel_size"


def check_expert_parallel(size: Any) -> None:
    """MoE: the rollout must run every expert of a token on one rank (its combine is what we mirror)."""
    if size not in (None, 1):
        raise AlignmentError(
            f"{EP_KEY}={size}: MoE alignment mirrors experts combined on one rank only (expert parallel sums the "
            f"ranks' partial outputs in bf16); set {EP_KEY}=1 or alignment.regions=[]"
        )


def check_kernels(value: Any, compile_value: Any) -> str:
    """``alignment.kernels``: ``torch`` (default) or the opt-in ``triton``, never together with compile."""
    from ..kernels import KERNELS

    kernels = str(value or "torch").strip().lower()
    if kernels not in KERNELS:
        raise AlignmentError(f"alignment.kernels={kernels!r}: use torch (default) or triton")
    if kernels == "triton" and option_bool(compile_value, name="alignment.compile", default=False):
        raise AlignmentError(
            "alignment.kernels=triton and alignment.compile=true both replace SwiGLU/RoPE; choose one"
        )
    return kernels
