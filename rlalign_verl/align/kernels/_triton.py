"""The Triton kernels behind :mod:`rlalign_verl.align.kernels` (imported only when a kernel is used)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rlalign_verl.align.kernels.interpreter import interpreter_active

_BLOCK = 1024
_HALF_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load as fp32. KIND 0: bf16 passed as int16 bits; 1: fp16; 2: fp32."""
    if KIND == 0:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rne_bf16_bits(x):
    """fp32 -> bf16 bit pattern (in a uint32), round to nearest even; NaN stays a quiet NaN."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, (b >> 16) | 0x40, r)


@triton.jit
def _round(x, KIND: tl.constexpr):
    """``R(x)`` as an fp32 value: bf16 (KIND 0) or fp16 (KIND 1) rounding."""
    if KIND == 0:
        return (_rne_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _store(ptr, offs, x, mask, KIND: tl.constexpr):
    """Store fp32 ``x`` rounded to the output dtype (bf16 as int16 bits, or fp16)."""
    if KIND == 0:
        tl.store(ptr + offs, _rne_bf16_bits(x).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)


@triton.jit
def _swiglu_kernel(
    g_ptr,
    u_ptr,
    out_ptr,
    n,
    KIND: tl.constexpr,
    ROUND_SILU: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = _load_f32(g_ptr, offs, mask, KIND)
    u = _load_f32(u_ptr, offs, mask, KIND)
    if PRECISE_EXP:
        # PyTorch's CUDA silu: x / (1 + expf(-x)) with IEEE division
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)  # interpreter: numpy's exp
    a = tl.div_rn(g, 1.0 + e)
    if ROUND_SILU:
        a = _round(a, KIND)
    _store(out_ptr, offs, a * u, mask, KIND)


@triton.jit
def _rope_kernel(
    x_ptr,
    c_ptr,
    s_ptr,
    out_ptr,
    H,
    T,
    D,
    HALF: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    THREE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * T + t
    t = row % T
    b = row // (H * T)
    trow = b * T + t
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    xo = row * D
    to = trow * D
    x1 = _load_f32(x_ptr, xo + j, mask, IN_KIND)
    x2 = _load_f32(x_ptr, xo + HALF + j, mask, IN_KIND)
    c1 = tl.load(c_ptr + to + j, mask=mask, other=0.0)
    c2 = tl.load(c_ptr + to + HALF + j, mask=mask, other=0.0)
    s1 = tl.load(s_ptr + to + j, mask=mask, other=0.0)
    s2 = tl.load(s_ptr + to + HALF + j, mask=mask, other=0.0)
    if THREE:
        o1 = _round(x1 * c1, OUT_KIND) - _round(x2 * s1, OUT_KIND)
        o2 = _round(x2 * c2, OUT_KIND) + _round(x1 * s2, OUT_KIND)
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    _store(out_ptr, xo + j, o1, mask, OUT_KIND)
    _store(out_ptr, xo + HALF + j, o2, mask, OUT_KIND)


def _kind(dtype: torch.dtype, what: str) -> int:
    if dtype not in _HALF_DTYPES:
        raise TypeError(f"the Triton {what} kernel handles bf16/fp16 activations, got {dtype}")
    return _HALF_DTYPES[dtype]


def _arg(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors travel as their int16 bits (the kernels round and widen them by hand)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, roundings: int) -> torch.Tensor:
    if roundings not in (1, 2):
        raise ValueError(f"SwiGLU roundings must be 1 or 2, got {roundings}")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {gate.dtype}{tuple(gate.shape)} and up {up.dtype}{tuple(up.shape)} differ")
    kind = _kind(gate.dtype, "SwiGLU")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, _BLOCK),)](
            _arg(g),
            _arg(u),
            _arg(out),
            n,
            KIND=kind,
            ROUND_SILU=roundings == 2,
            PRECISE_EXP=not interpreter_active(),
            BLOCK=_BLOCK,
            enable_fp_fusion=False,
        )
    return out


def rope_forward(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, roundings: int, out_dtype: torch.dtype
) -> torch.Tensor:
    if roundings not in (1, 3):
        raise ValueError(f"RoPE roundings must be 1 or 3, got {roundings}")
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(
            f"x must be [batch, heads, seq, head_dim] with an even head_dim, got {tuple(x.shape)}"
        )
    bsz, heads, seq, dim = x.shape
    c = cos.reshape(cos.shape[0], -1, dim).float()
    s = sin.reshape(sin.shape[0], -1, dim).float()
    if c.shape[1] != seq or s.shape != c.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    c = c.expand(bsz, seq, dim).contiguous()
    s = s.expand(bsz, seq, dim).contiguous()
    in_kind = 2 if x.dtype == torch.float32 else _kind(x.dtype, "RoPE")
    out_kind = _kind(out_dtype, "RoPE")
    xc = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = bsz * heads * seq
    if rows:
        half = dim // 2
        _rope_kernel[(rows,)](
            _arg(xc),
            c,
            s,
            _arg(out),
            heads,
            seq,
            dim,
            HALF=half,
            IN_KIND=in_kind,
            OUT_KIND=out_kind,
            THREE=roundings == 3,
            BLOCK=triton.next_power_of_2(half),
            enable_fp_fusion=False,
        )
    return out
