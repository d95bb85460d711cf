"""Comparing our outputs with the engine's, bit by bit: identical elements and ULP distances."""

from __future__ import annotations

from typing import Any

import torch


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to integers whose order is the float order (+0 and -0 both map to 0)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        i, mag = t.contiguous().view(torch.int16).to(torch.int64), 0x7FFF
    elif t.dtype == torch.float32:
        i, mag = t.contiguous().view(torch.int32).to(torch.int64), 0x7FFFFFFF
    else:
        raise TypeError(f"ULP distance needs bf16, fp16 or fp32 tensors, got {t.dtype}")
    return torch.where(i < 0, -(i & mag), i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ULPs of ``a``'s dtype (int64). A NaN against a non-NaN counts as 2**31."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    d = (_ordered_bits(a) - _ordered_bits(b)).abs()
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    return torch.where(na ^ nb, torch.full_like(d, 2**31), d)


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same bit pattern (so +0 vs -0 differ, equal NaN payloads match)."""
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return a.contiguous().view(width) == b.contiguous().view(width)


def compare(engine: torch.Tensor, ours: torch.Tensor) -> dict[str, Any]:
    """Fraction of bit-identical elements, count of differing ones, max and mean ULP distance."""
    same = bit_identical(engine, ours)
    ulp = ulp_distance(engine, ours)
    n = same.numel()
    return {
        "n": n,
        "identical": float(same.sum().item()) / max(n, 1),
        "differing": int(n - same.sum().item()),
        "max_ulp": int(ulp.max().item()) if n else 0,
        "mean_ulp": float(ulp.double().mean().item()) if n else 0.0,
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool several :func:`compare` results (weighted by element count)."""
    n = sum(p["n"] for p in parts)
    return {
        "n": n,
        "identical": sum(p["identical"] * p["n"] for p in parts) / max(n, 1),
        "differing": sum(p["differing"] for p in parts),
        "max_ulp": max(p["max_ulp"] for p in parts),
        "mean_ulp": sum(p["mean_ulp"] * p["n"] for p in parts) / max(n, 1),
    }


# --- the op probe ---------------------------------------------------------------------------------
