"""Which vLLM execution path a ``compilation_config`` describes: compiled (Inductor, native region ops) or eager
(every region CustomOp runs its C++/CUDA kernel). Read by the verl driver's auto profile choice and by the
rollout-dump header checks of ``diagnose``, so both read vLLM's settings alike. Facts from vLLM 0.31
(``vllm/config/compilation.py``: ``CompilationMode`` NONE = 0, STOCK_TORCH_COMPILE = 1, DYNAMO_TRACE_ONCE = 2
(what the CPU platform runs), VLLM_COMPILE = 3; the older ``level`` key numbers the same paths; ``custom_ops``
``"all"`` / ``"+name"`` / ``"-name"`` turn CustomOp kernels on and off).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REGION_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding")
"""The CustomOp names whose CUDA/C++ kernels replace the three regions' native forwards in vLLM."""

_EAGER_MODES = ("0", "NONE", "NO_COMPILATION")
_COMPILED_MODES = ("1", "2", "3", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE", "DYNAMO_AS_IS",
                   "DYNAMO_ONCE", "PIECEWISE")  # fmt: skip


def compilation_mode(cc: Mapping[str, Any]) -> str | None:
    """``"eager"`` or ``"compiled"`` from ``cc``'s ``mode`` (or older ``level``), in any of the spellings vLLM
    prints (``0``, ``"NONE"``, ``"none"``, ``"CompilationMode.NONE"``); ``None`` when neither key is given.
    Raises ``ValueError`` naming the value for one vLLM does not have."""
    mode = cc.get("mode", cc.get("level"))
    if mode is None:
        return None
    text = str(mode).strip().upper().removeprefix("COMPILATIONMODE.").removeprefix("COMPILATIONLEVEL.")
    if isinstance(mode, bool) or text not in _EAGER_MODES + _COMPILED_MODES:
        raise ValueError(
            f"compilation mode {mode!r} is not a vLLM compilation mode (0-3 / NONE .. VLLM_COMPILE)"
        )
    return "eager" if text in _EAGER_MODES else "compiled"


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
