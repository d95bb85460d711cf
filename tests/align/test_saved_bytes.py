"""benchmarks/saved_bytes.py: the bytes autograd saves for backward, counted per unique storage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "saved_bytes", Path(__file__).resolve().parents[2] / "benchmarks" / "saved_bytes.py"
)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
saved_bytes = _mod.saved_bytes


def _leaf(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_(True)


def test_new_output_saved():
    x = _leaf(4, 8)
    # exp saves its fp32 output: 4*8*4 = 128 bytes, none of it the input's
    assert saved_bytes(lambda: x.float().exp(), [x]) == (128, 128)


def test_inputs_saved_are_not_new():
    x, y = _leaf(4, 8), _leaf(4, 8)
    # mul saves both bf16 operands: 2 * 4*8*2 = 128 bytes, both inputs
    assert saved_bytes(lambda: x * y, [x, y]) == (128, 0)


def test_shared_storage_counts_once():
    x = _leaf(8, 8)
    # x.t() is a view of x: mul saves one storage of 8*8*2 = 128 bytes
    assert saved_bytes(lambda: x.t() * x, [x]) == (128, 0)
    # without the input list the same storage is counted as new
    assert saved_bytes(lambda: x.t() * x) == (128, 128)


def test_nothing_saved_without_grad():
    x = _leaf(4, 8)
    with torch.no_grad():
        assert saved_bytes(lambda: x.float().exp() * 2, [x]) == (0, 0)
