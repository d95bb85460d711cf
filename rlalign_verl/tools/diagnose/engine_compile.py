"""How the vLLM CPU build compiles and dispatches its ops, shared by the dense and MoE engine-op wrappers."""

from __future__ import annotations

import functools
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


@functools.cache
def compiled_fn(fn: Callable) -> Callable:
    """``fn`` compiled by Inductor as the CPU platform compiles the whole model."""
    return torch.compile(fn, backend="inductor", dynamic=True, fullgraph=True, options=CPU_INDUCTOR_OPTIONS)


def native_op(op_name: str) -> Callable:
    """vLLM's native (PyTorch) implementation of an IR op."""
    from vllm import ir

    return getattr(ir.ops, op_name).impls["native"].impl_fn
