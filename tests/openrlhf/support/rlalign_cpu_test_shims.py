"""CPU-test shims for OpenRLHF's test environment (.venv-openrlhf). Test code only: never shipped.

OpenRLHF imports two things that a CPU machine lacks:

- ``flash_attn_2_cuda``: the CUDA extension of flash-attn, which ``import flash_attn`` loads (flash-attn
  is installed Python-only by scripts/setup_openrlhf.sh; ``openrlhf.models`` imports
  ``flash_attn.bert_padding`` at module level). The stub is an empty module: no test calls a flash kernel.
- ``vllm``: imported at module level by ``openrlhf.trainer.*``; vLLM 0.29's CUDA build cannot be installed
  here. The stub provides the names those imports need (``__version__``, ``SamplingParams``,
  ``inputs.TokensPrompt``, ``utils.random_uuid``); no test generates with it.

Each stub is installed only when the real module cannot be found. ``sitecustomize.py`` beside this file
installs them in every Python process started with this folder on ``PYTHONPATH`` (the conftest puts
it there before Ray starts, so Ray's worker processes get them too).
"""

from __future__ import annotations

import importlib.util
import sys
import types
import uuid

STUB_MARK = "__rlalign_cpu_test_stub__"


class SamplingParams:
    """Stand-in for ``vllm.SamplingParams``: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def __repr__(self) -> str:
        return f"SamplingParams({self.__dict__})"


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    setattr(module, STUB_MARK, True)
    return module


def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install() -> list[str]:
    """Register the stubs that are needed in this process; return their names."""
    installed = []
    if _missing("flash_attn_2_cuda"):
        sys.modules["flash_attn_2_cuda"] = _module("flash_attn_2_cuda")
        installed.append("flash_attn_2_cuda")
    if _missing("vllm"):
        inputs = _module("vllm.inputs", TokensPrompt=dict)
        utils = _module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
        vllm = _module(
            "vllm", __version__="0.29.0", SamplingParams=SamplingParams, inputs=inputs, utils=utils
        )
        SamplingParams.__module__ = "vllm"
        sys.modules.update({"vllm": vllm, "vllm.inputs": inputs, "vllm.utils": utils})
        installed.append("vllm")
    return installed
