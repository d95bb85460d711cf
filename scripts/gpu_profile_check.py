#!/usr/bin/env python
"""Check the CUDA engine profiles against the engines' own CUDA ops, region by region.

For every region (rmsnorm, add+rmsnorm, swiglu, rope, plus the Qwen3 q/k-norm -> RoPE chain and the
``vllm`` graph piece) and every CUDA profile (``vllm-eager``, ``vllm``, ``sglang`` when ``sgl_kernel`` is
importable), this runs the engine's op and our region function (:mod:`rlalign_verl.regions`) on the
same random bf16 inputs and reports the fraction of bit-identical output elements and the largest
distance in units in the last place (ULP). Engine ops:

* ``vllm-eager``: vLLM's CUDA kernels ``torch.ops._C.rms_norm``, ``fused_add_rms_norm``,
  ``silu_and_mul``, ``rotary_embedding`` (what ``enforce_eager=True`` runs);
* ``vllm``: vLLM's native op implementations compiled with ``torch.compile(backend="inductor")``
  and a dynamic token dimension, the way vLLM's default (compiled) path runs them;
* ``sglang``: ``sgl_kernel.rmsnorm``, ``fused_add_rmsnorm``, ``silu_and_mul``,
  ``apply_rope_with_cos_sin_cache_inplace`` with SGLang's fp32 cos/sin cache.

On CUDA it also compares the optional Triton kernels (:mod:`rlalign_verl.kernels`, profile column
``triton``) with the PyTorch region functions they replace (expected: 100 % identical).

Each norm/SwiGLU/RoPE row also scores the other rounding variants a profile could have (``best``
column), so a mismatch says which field value the engine really uses.

Run on a GPU machine with vLLM's CUDA build (no network needed, a few minutes)::

    python scripts/gpu_profile_check.py            # table on stdout, JSON to $OUT/ or ./gpu_check.json
    python scripts/gpu_profile_check.py --quick    # two hidden sizes only

Without CUDA or without vLLM's CUDA build it prints ``skipped: ...`` and exits 0. ``--device cpu`` runs
the same machinery against vLLM's CPU ops (a development aid: its numbers say nothing about CUDA).
On CPU each engine is checked against its CPU build's profile (``vllm`` -> ``vllm-cpu``, ``vllm-eager`` ->
``vllm-cpu-eager``); ``--plant PROFILE`` checks every engine against PROFILE instead (a self-test: a wrong
profile must fail). Exit status: 0 when every row passes, 1 when any case raised, any row's best rounding
variant is not the profile's own, a Triton row is not bit-identical, or nothing was compared (the reasons
are printed and in the JSON's ``problems``); 2 for bad arguments.

End-to-end step (when ``vllm`` is among ``--profiles``; ``--no-e2e`` skips it, ``--e2e-only`` runs only it):
:mod:`rlalign_verl.diagnose.e2e_check` samples rollouts from a tiny local model with the installed engine
(vLLM's CUDA build on CUDA), recomputes them with each region setting and the floor, and fails when all
regions do not reach the floor's interval or are not below ``none`` (key ``e2e`` in the JSON).
On CUDA it also runs ``scripts/gpu_moe_check.py``'s rows (vLLM's fused MoE router and experts vs the
``vllm`` profile's MoE data, top-k 2 and 8; key ``moe``; where sglang imports, SGLang's router, experts and
Qwen2-MoE block sum vs the ``sglang`` profile's, keys ``moe.sglang_top2/8``); each of its misses is a problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the one bit-level comparison helper (pure torch), shared with diagnose and the tests
from rlalign_verl.diagnose.bits import bit_identical, compare, ulp_distance  # noqa: F401

CUDA_PROFILES = ("vllm-eager", "vllm", "sglang")
HIDDEN_SIZES = (896, 1536, 2048, 3584, 4096)
# intermediate sizes of real models with those hidden sizes (Qwen2.5-0.5B/1.5B, Qwen3-1.7B, Qwen2.5-7B, Llama-2-7B)
INTERMEDIATE = {896: 4864, 1536: 8960, 2048: 6144, 3584: 18944, 4096: 11008}
TOKENS = (7, 300)  # below and above vLLM's 256-token block-size switch
SCALES = (0.01, 1.0, 30.0)
ROPE_SHAPES = ((64, 14, 2), (128, 28, 4))  # (head_dim, q heads, kv heads)
MAX_POSITION = 32768
ROPE_THETA = 1_000_000.0
EPS = 1e-6
KERNEL_SHAPE = (2, 16, 300, 128)  # (batch, heads, tokens, head_dim) for the Triton kernel rows


# --- environment --------------------------------------------------------------------------------


def environment_status(device: str) -> tuple[bool, str]:
    """``(ok, reason)``: whether this machine can run the check on ``device``."""
    if device == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine"
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed"
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
        from vllm.platforms import current_platform
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        return False, f"vLLM cannot be imported ({type(exc).__name__}: {exc})"
    if device == "cuda" and not current_platform.is_cuda():
        return False, f"this vLLM is not the CUDA build (platform: {type(current_platform).__name__})"
    missing = [
        op
        for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
        if not hasattr(torch.ops._C, op)
    ]
    if missing:
        return False, f"vLLM's compiled ops are missing: {missing}"
    return True, "ok"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover
        return "unknown"


# --- engines ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Engine:
    """The engine-side implementation of each region for one profile."""

    profile: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (positions, q, k, head_size, cache)
    cache_dtype: torch.dtype
    piece: Callable[..., tuple[torch.Tensor, ...]] | None = None
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def _vllm_eager_engine() -> Engine:
    ops = torch.ops._C

    def rms(x, w, eps):
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, eps)
        return out

    def add_rms(h, r, w, eps):
        h2, r2 = h.clone(), r.clone()
        ops.fused_add_rms_norm(h2, r2, w, eps)
        return h2, r2

    def silu(gu):
        out = torch.empty(*gu.shape[:-1], gu.shape[-1] // 2, dtype=gu.dtype, device=gu.device)
        ops.silu_and_mul(out, gu)
        return out

    def rope(pos, q, k, head_size, cache):
        q2, k2 = q.clone(), k.clone()
        ops.rotary_embedding(pos, q2, k2, head_size, cache, True)
        return q2, k2

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = rms(q.view(t, -1, head_size).contiguous(), wq, eps).view(t, -1)
        kn = rms(k.view(t, -1, head_size).contiguous(), wk, eps).view(t, -1)
        return rope(pos, qn, kn, head_size, cache)

    return Engine("vllm-eager", rms, add_rms, silu, rope, torch.bfloat16, qk_norm_rope=qk_rope)


def _mark_tokens_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


def _vllm_compiled_engine() -> Engine:
    from vllm import ir
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    native_rms = ir.ops.rms_norm.impls["native"].impl_fn
    native_add_rms = ir.ops.fused_add_rms_norm.impls["native"].impl_fn

    def _rms(x, w, eps):
        return native_rms(x, w, eps)

    def _add_rms(h, r, w, eps):
        return native_add_rms(h, r, w, eps)

    def _silu(gu):
        return SiluAndMul.forward_native(gu)

    def _rope(pos, q, k, head_size, cache):
        return RotaryEmbedding.forward_static(pos, q, k, head_size, head_size, cache, True)

    def _piece(h1, r0, w1, h2, w2, eps):
        # post-attention norm -> (MLP, here an independent h2) -> next input norm; the residual between
        # the two norms is not an output of the piece, as in vLLM's graph split at attention.
        y1, r1 = native_add_rms(h1, r0, w1, eps)
        y2, r2 = native_add_rms(h2, r1, w2, eps)
        return y1, y2, r2

    def _qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = native_rms(q.view(t, -1, head_size), wq, eps).view(t, -1)
        kn = native_rms(k.view(t, -1, head_size), wk, eps).view(t, -1)
        return RotaryEmbedding.forward_static(pos, qn, kn, head_size, head_size, cache, True)

    compiled = {
        name: torch.compile(fn, backend="inductor")
        for name, fn in (
            ("rms", _rms),
            ("add", _add_rms),
            ("silu", _silu),
            ("rope", _rope),
            ("piece", _piece),
            ("qk", _qk_rope),
        )
    }

    def rms(x, w, eps):
        _mark_tokens_dynamic(x)
        return compiled["rms"](x, w, eps)

    def add_rms(h, r, w, eps):
        _mark_tokens_dynamic(h, r)
        return compiled["add"](h, r, w, eps)

    def silu(gu):
        _mark_tokens_dynamic(gu)
        return compiled["silu"](gu)

    def rope(pos, q, k, head_size, cache):
        _mark_tokens_dynamic(pos, q, k)
        return compiled["rope"](pos, q, k, head_size, cache)

    def piece(h1, r0, w1, h2, w2, eps):
        _mark_tokens_dynamic(h1, r0, h2)
        return compiled["piece"](h1, r0, w1, h2, w2, eps)

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        _mark_tokens_dynamic(pos, q, k)
        return compiled["qk"](pos, q, k, wq, wk, head_size, cache, eps)

    return Engine("vllm", rms, add_rms, silu, rope, torch.bfloat16, piece=piece, qk_norm_rope=qk_rope)


def _sglang_engine() -> Engine:
    import sgl_kernel

    def rms(x, w, eps):
        return sgl_kernel.rmsnorm(x.contiguous(), w, eps)

    def add_rms(h, r, w, eps):
        h2, r2 = h.clone(), r.clone()
        sgl_kernel.fused_add_rmsnorm(h2, r2, w, eps)
        return h2, r2

    def silu(gu):
        return sgl_kernel.silu_and_mul(gu)

    def rope(pos, q, k, head_size, cache):
        q2, k2 = q.clone(), k.clone()
        sgl_kernel.apply_rope_with_cos_sin_cache_inplace(
            positions=pos, query=q2, key=k2, head_size=head_size, cos_sin_cache=cache, is_neox=True
        )
        return q2, k2

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = rms(q.reshape(-1, head_size), wq, eps).view(t, -1)
        kn = rms(k.reshape(-1, head_size), wk, eps).view(t, -1)
        return rope(pos, qn, kn, head_size, cache)

    return Engine("sglang", rms, add_rms, silu, rope, torch.float32, qk_norm_rope=qk_rope)


def make_engines(profiles: list[str]) -> tuple[dict[str, Engine], dict[str, str]]:
    """The engines for ``profiles``; profiles that cannot run here come back in the second dict."""
    engines: dict[str, Engine] = {}
    unavailable: dict[str, str] = {}
    builders = {"vllm-eager": _vllm_eager_engine, "vllm": _vllm_compiled_engine, "sglang": _sglang_engine}
    for name in profiles:
        if name == "sglang" and importlib.util.find_spec("sgl_kernel") is None:
            unavailable[name] = "sgl_kernel is not installed"
            continue
        try:
            engines[name] = builders[name]()
        except Exception as exc:
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    return engines, unavailable


# --- region side --------------------------------------------------------------------------------


def _norm_variants(base, with_residual: bool) -> list[tuple[str, Any]]:
    from rlalign_verl.profiles import Mean, NormRounding, Source

    sources = (
        [
            (Source.FP32_SUM, Source.FP32_SUM),
            (Source.FP32_SUM, Source.ROUNDED_SUM),
            (Source.ROUNDED_SUM, Source.ROUNDED_SUM),
        ]
        if with_residual
        else [(base.variance, base.normalize)]
    )
    out = []
    for (var, nrm), rnd, mean in itertools.product(sources, (1, 2), (Mean.MEAN, Mean.SUM_DIV_N)):
        label = f"out{rnd}/{mean.value}" + (f"/var={var.value}/norm={nrm.value}" if with_residual else "")
        out.append((label, NormRounding(var, nrm, output_roundings=rnd, mean=mean)))
    return out


def _to_heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """Engine layout ``[T, H*D]`` -> region layout ``[1, H, T, D]``."""
    t = x.shape[0]
    return x.reshape(t, -1, head_size).transpose(0, 1).unsqueeze(0)


def _from_heads(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1).reshape(x.shape[2], -1)


def _table_from_cache(cache: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-layout ``cos, sin`` (``[1, T, D]``, halves duplicated) in fp32 from an engine cos_sin_cache."""
    rows = cache.index_select(0, pos).float()
    cos, sin = rows.chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1).unsqueeze(0), torch.cat((sin, sin), dim=-1).unsqueeze(0)


def _region_rope(q, k, pos, cache, head_size, rounding, *, q_fp32=None, k_fp32=None):
    from rlalign_verl.regions.rope import apply_rope

    cos, sin = _table_from_cache(cache, pos)
    qh = _to_heads(q if q_fp32 is None else q_fp32, head_size)
    kh = _to_heads(k if k_fp32 is None else k_fp32, head_size)
    qo, ko = apply_rope(qh, kh, cos, sin, rounding, out_dtype=torch.bfloat16)
    return _from_heads(qo), _from_heads(ko)


# --- cases --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    region: str
    profile: str
    shape: str
    output: str
    result: dict[str, Any] | None = None
    best: tuple[str, float] | None = None
    variants: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None


def _score_variants(
    engine_out: torch.Tensor, fn: Callable[[Any], torch.Tensor], variants
) -> dict[str, float]:
    scores = {}
    for label, v in variants:
        scores[label] = float(bit_identical(engine_out, fn(v)).float().mean().item())
    return scores


def _finish(row: Row, engine_out: torch.Tensor, ours: torch.Tensor, scores: dict[str, float]) -> Row:
    row.result = compare(engine_out, ours)
    row.variants = scores
    if scores:
        top = max(scores.values())
        row.best = (" = ".join(label for label, v in scores.items() if v == top), top)
    return row


def _guarded(
    region: str, profile: str, shape: str, outputs: tuple[str, ...], body: Callable[[list[Row]], None]
) -> list[Row]:
    """Rows for one case; if the case raises, every output row carries the error instead of numbers."""
    rows = [Row(region, profile, shape, o) for o in outputs]
    try:
        body(rows)
    except Exception as exc:
        for row in rows:
            row.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    return rows


def case_rmsnorm(eng: Engine, prof, x, w, shape: str) -> list[Row]:
    from rlalign_verl.regions.rmsnorm import rms_norm

    def body(rows: list[Row]) -> None:
        eo = eng.rms_norm(x, w, EPS)
        scores = _score_variants(eo, lambda v: rms_norm(x, w, EPS, v), _norm_variants(prof.norm, False))
        _finish(rows[0], eo, rms_norm(x, w, EPS, prof.norm), scores)

    return _guarded("rmsnorm", eng.profile, shape, ("out",), body)


def case_add_rmsnorm(eng: Engine, prof, x, r, w, shape: str) -> list[Row]:
    from rlalign_verl.profiles import Residual
    from rlalign_verl.regions.rmsnorm import add_rms_norm

    round_res = prof.residual is not Residual.NEVER

    def body(rows: list[Row]) -> None:
        eo, er = eng.add_rms_norm(x, r, w, EPS)
        oy, orr = add_rms_norm(x, r, w, EPS, prof.norm, round_residual=round_res)
        scores = _score_variants(
            eo,
            lambda v: add_rms_norm(x, r, w, EPS, v, round_residual=round_res)[0],
            _norm_variants(prof.norm, True),
        )
        _finish(rows[0], eo, oy, scores)
        _finish(rows[1], er, orr.to(er.dtype), {})

    return _guarded("add_rmsnorm", eng.profile, shape, ("out", "residual"), body)


def case_swiglu(eng: Engine, prof, gu, inter: int, shape: str) -> list[Row]:
    from rlalign_verl.profiles import SwigluRounding
    from rlalign_verl.regions._precision import store_as
    from rlalign_verl.regions.swiglu import swiglu

    def body(rows: list[Row]) -> None:
        eo = eng.silu_and_mul(gu)
        g, u = gu[..., :inter], gu[..., inter:]
        scores = _score_variants(
            eo, lambda v: swiglu(g, u, v), [(f"r{n}", SwigluRounding(n)) for n in (1, 2)]
        )
        # one rounding stored by truncation: vLLM's CPU kernels built without AVX512-BF16 (a CUDA kernel never is)
        act = torch.nn.functional.silu(g.float()) * u.float()
        scores["r1/truncate"] = float(bit_identical(eo, store_as(act, "truncate", eo.dtype)).float().mean())
        _finish(rows[0], eo, swiglu(g, u, prof.swiglu), scores)

    return _guarded("swiglu", eng.profile, shape, ("out",), body)


def case_rope(eng: Engine, prof, q, k, pos, cache, head_size: int, shape: str) -> list[Row]:
    from rlalign_verl.profiles import RopeRounding

    def body(rows: list[Row]) -> None:
        eq, ek = eng.rope(pos, q, k, head_size, cache)
        oq, ok = _region_rope(q, k, pos, cache, head_size, prof.rope)
        variants = [(f"r{n}", RopeRounding(prof.rope.table, n)) for n in (1, 3)]
        variants.append(
            ("r1/truncate", RopeRounding(prof.rope.table, 1, "truncate"))
        )  # vLLM CPU without AVX512-BF16
        scores = _score_variants(eq, lambda v: _region_rope(q, k, pos, cache, head_size, v)[0], variants)
        _finish(rows[0], eq, oq, scores)
        _finish(rows[1], ek, ok, {})

    return _guarded("rope", eng.profile, shape, ("q", "k"), body)


def case_qknorm_rope(eng: Engine, prof, q, k, wq, wk, pos, cache, head_size: int, shape: str) -> list[Row]:
    """Qwen3: per-head RMSNorm of q/k, then RoPE (is the normalised value rounded in between?)."""
    from rlalign_verl.regions.rmsnorm import rms_norm

    tokens = q.shape[0]

    def ours(rounded: bool) -> torch.Tensor:
        qn = rms_norm(q.view(tokens, -1, head_size), wq, EPS, prof.norm, keep_fp32=not rounded)
        kn = rms_norm(k.view(tokens, -1, head_size), wk, EPS, prof.norm, keep_fp32=not rounded)
        qn, kn = qn.reshape(tokens, -1), kn.reshape(tokens, -1)
        return _region_rope(q, k, pos, cache, head_size, prof.rope, q_fp32=qn, k_fp32=kn)[0]

    def body(rows: list[Row]) -> None:
        assert eng.qk_norm_rope is not None
        eq, _ = eng.qk_norm_rope(pos, q, k, wq, wk, head_size, cache, EPS)
        scores = {
            f"qk_rounded={b}": float(bit_identical(eq, ours(b)).float().mean().item()) for b in (True, False)
        }
        _finish(rows[0], eq, ours(prof.qk_norm_rounded_before_rope), scores)

    return _guarded("qknorm_rope", eng.profile, shape, ("q",), body)


def case_piece(eng: Engine, prof, h1, r0, w1, h2, w2, shape: str) -> list[Row]:
    """vLLM's compiled piece: post-attention add+norm, then the next input add+norm, residual not stored between."""
    from rlalign_verl.profiles import Residual
    from rlalign_verl.regions.rmsnorm import add_rms_norm

    def ours(mid_rounded: bool):
        y1, r1 = add_rms_norm(h1, r0, w1, EPS, prof.norm, round_residual=mid_rounded)
        y2, r2 = add_rms_norm(h2, r1, w2, EPS, prof.norm, round_residual=True)
        return y1, y2, r2

    def body(rows: list[Row]) -> None:
        assert eng.piece is not None
        e1, e2, er = eng.piece(h1, r0, w1, h2, w2, EPS)
        o1, o2, orr = ours(prof.residual is Residual.EVERY_ADD)  # AT_ATTENTION / NEVER: not stored mid-piece
        scores = {
            f"mid_residual_rounded={b}": float(bit_identical(e2, ours(b)[1]).float().mean().item())
            for b in (True, False)
        }
        _finish(rows[0], e1, o1, {})
        _finish(rows[1], e2, o2, scores)
        _finish(rows[2], er, orr.to(er.dtype), {})

    return _guarded("piece", eng.profile, shape, ("out1", "out2", "residual2"), body)


def run_cases(
    engines: dict[str, Engine], device: str, quick: bool, seed: int, checked: dict[str, str] | None = None
) -> list[Row]:
    """Every case for every engine, on fresh random bf16 inputs (``seed``); ``checked`` maps an engine to
    the profile compared with it (default: the engine's own name)."""
    from rlalign_verl.profiles import get_profile

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale + mean).to(torch.bfloat16).to(device)

    def weight(n: int) -> torch.Tensor:
        return randn(n, scale=0.2, mean=1.0)

    hidden_sizes = (896, 4096) if quick else HIDDEN_SIZES
    rows: list[Row] = []
    for name, eng in engines.items():
        prof = get_profile((checked or {}).get(name, name))
        for hidden, tokens in itertools.product(hidden_sizes, TOKENS):
            scale = SCALES[(hidden // 512 + tokens) % len(SCALES)]
            x, r, w = (
                randn(tokens, hidden, scale=scale),
                randn(tokens, hidden, scale=3 * scale),
                weight(hidden),
            )
            shape = f"T={tokens} H={hidden} x~{scale:g}"
            rows += case_rmsnorm(eng, prof, x, w, shape)
            rows += case_add_rmsnorm(eng, prof, x, r, w, shape)
            inter = INTERMEDIATE[hidden]
            gu = randn(tokens, 2 * inter, scale=min(2.0 * scale, 4.0))
            rows += case_swiglu(eng, prof, gu, inter, f"T={tokens} I={inter} x~{min(2.0 * scale, 4.0):g}")

        for head_size, nq, nkv in ROPE_SHAPES:
            tokens = 300
            cache = _engine_cache(head_size, eng.cache_dtype, device)
            pos = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
            q, k = randn(tokens, nq * head_size, scale=2.0), randn(tokens, nkv * head_size, scale=2.0)
            shape = f"T={tokens} D={head_size} heads={nq}/{nkv} pos<{MAX_POSITION}"
            rows += case_rope(eng, prof, q, k, pos, cache, head_size, shape)

        if eng.qk_norm_rope is not None:
            head_size, nq, nkv, tokens = 128, 16, 8, 300
            cache = _engine_cache(head_size, eng.cache_dtype, device)
            pos = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
            q, k = randn(tokens, nq * head_size, scale=3.0), randn(tokens, nkv * head_size, scale=3.0)
            rows += case_qknorm_rope(
                eng,
                prof,
                q,
                k,
                weight(head_size),
                weight(head_size),
                pos,
                cache,
                head_size,
                f"T={tokens} D={head_size} heads={nq}/{nkv}",
            )

        if eng.piece is not None:
            for hidden in (hidden_sizes[0], hidden_sizes[-1]):
                tokens = 300
                h1, r0, h2 = randn(tokens, hidden), randn(tokens, hidden, scale=4.0), randn(tokens, hidden)
                rows += case_piece(
                    eng, prof, h1, r0, weight(hidden), h2, weight(hidden), f"T={tokens} H={hidden} two norms"
                )

        rows += _table_rows(name, eng, device)
    return rows


def kernel_rows(device: str, quick: bool, seed: int) -> list[Row]:
    """The optional Triton kernels (rlalign_verl.kernels) against the PyTorch region functions they replace."""
    from rlalign_verl import kernels
    from rlalign_verl.profiles import RopeRounding, SwigluRounding
    from rlalign_verl.regions._precision import rnd
    from rlalign_verl.regions.rope import apply_rope, rope_table
    from rlalign_verl.regions.swiglu import swiglu

    if not kernels.available(torch.zeros(1, device=device), requested=True):
        return []
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    rows: list[Row] = []
    tokens = KERNEL_SHAPE[2]
    for inter in (4864,) if quick else (4864, 11008):
        g = (torch.randn(tokens, inter, generator=gen) * 3).to(torch.bfloat16).to(device)
        u = (torch.randn(tokens, inter, generator=gen) * 3).to(torch.bfloat16).to(device)
        for n in (1, 2):

            def body(rows_: list[Row], n: int = n, g: torch.Tensor = g, u: torch.Tensor = u) -> None:
                _finish(rows_[0], swiglu(g, u, SwigluRounding(n)), kernels.swiglu_forward(g, u, n), {})

            rows += _guarded("swiglu", "triton", f"T={tokens} I={inter} roundings={n}", ("out",), body)
    b, h, t, d = KERNEL_SHAPE
    q = (torch.randn(b, h, t, d, generator=gen) * 2).to(torch.bfloat16).to(device)
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.randint(0, MAX_POSITION, (b, t), generator=gen).to(device)
    cos, sin = rope_table(inv.to(device), pos)
    for table, n in itertools.product(("bf16", "fp32"), (1, 3)):

        def body(rows_: list[Row], table: str = table, n: int = n) -> None:
            ref, _ = apply_rope(q, q, cos, sin, RopeRounding(table, n))
            c = rnd(cos, torch.bfloat16) if table == "bf16" else cos
            s_ = rnd(sin, torch.bfloat16) if table == "bf16" else sin
            _finish(
                rows_[0], ref, kernels.rope_forward(q, c.unsqueeze(1), s_.unsqueeze(1), n, torch.bfloat16), {}
            )

        rows += _guarded("rope", "triton", f"T={t} D={d} table={table} roundings={n}", ("q",), body)
    return rows


def _engine_cache(head_size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The engine's own cos_sin_cache, built by vLLM's RotaryEmbedding on ``device`` (as at model init).

    vLLM casts the fp32 cache to the model dtype; SGLang keeps it fp32 on CUDA (same formula).
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()), torch.device(device):
        rope = get_rope(head_size, MAX_POSITION, True, {"rope_theta": ROPE_THETA}, torch.bfloat16)
        cache = rope._compute_cos_sin_cache() if dtype == torch.float32 else rope.cos_sin_cache
    return cache.to(device=device, dtype=dtype)


def _table_rows(name: str, eng: Engine, device: str) -> list[Row]:
    """Our table (HF's formula: inv_freq on the CPU, fp32 matmul on ``device``) vs the engine's cache."""
    from rlalign_verl.regions.rope import rope_table

    rows = []
    for head_size in (64, 128):
        row = Row("rope_table", name, f"D={head_size} pos<{MAX_POSITION}", "cos|sin")
        try:
            cache = _engine_cache(head_size, eng.cache_dtype, device)
            inv_freq = 1.0 / (
                ROPE_THETA ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size)
            )
            pos = torch.arange(MAX_POSITION, device=device)[None, :]
            cos, sin = rope_table(inv_freq.to(device), pos)
            half = head_size // 2
            ours = torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1).to(eng.cache_dtype)
            _finish(row, cache, ours, {})
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
    return rows


# --- output -------------------------------------------------------------------------------------


def verdict(rows: list[Row]) -> list[str]:
    """Why this run fails (empty: it passes): a case that raised, a row where another rounding variant
    matches the engine better than the profile's own, a Triton row that is not bit-identical, or nothing
    compared at all."""
    problems = [f"{r.region}/{r.profile}/{r.shape}/{r.output}: {r.error}" for r in rows if r.error]
    compared = [r for r in rows if r.result is not None]
    if not compared:
        problems.append("nothing was compared (no engine could run here)")
    for r in compared:
        own = r.result["identical"]
        if r.best is not None and r.best[1] - own > 1e-6:  # float noise between the two fraction sums
            problems.append(
                f"{r.region}/{r.profile}/{r.shape}/{r.output}: the profile matches {100 * own:.3f}% but "
                f"{r.best[0]} matches {100 * r.best[1]:.3f}%"
            )
        elif r.profile == "triton" and own < 1.0:
            problems.append(
                f"{r.region}/triton/{r.shape}: Triton kernel {100 * own:.3f}% identical to PyTorch"
            )
    return problems


def format_table(rows: list[Row]) -> str:
    head = f"{'region':<12} {'profile':<10} {'shape':<36} {'output':<9} {'identical':>10} {'differ':>7} {'max_ulp':>8}  best variant"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.region:<12} {r.profile:<10} {r.shape:<36} {r.output:<9} ERROR {r.error}")
            continue
        assert r.result is not None
        best = f"{r.best[0]} ({100 * r.best[1]:.3f}%)" if r.best else ""
        lines.append(
            f"{r.region:<12} {r.profile:<10} {r.shape:<36} {r.output:<9} "
            f"{100 * r.result['identical']:>9.3f}% {r.result['differing']:>7} {r.result['max_ulp']:>8}  {best}"
        )
    return "\n".join(lines)


def default_json_path(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--profiles",
        default=",".join(CUDA_PROFILES),
        help=f"comma-separated subset of {', '.join(CUDA_PROFILES)}",
    )
    parser.add_argument("--quick", action="store_true", help="hidden sizes 896 and 4096 only")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: development run against vLLM's CPU ops (not a CUDA verification)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plant",
        default=None,
        help="check every engine against this (wrong) profile instead: the run must then exit 1",
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)"
    )
    _add_e2e_args(parser)
    args = parser.parse_args(argv)

    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in profiles if p not in CUDA_PROFILES]
    if bad:
        parser.error(f"unknown profile(s) {bad}; choose from {', '.join(CUDA_PROFILES)}")

    ok, reason = environment_status(args.device)
    if not ok:
        print(f"skipped: {reason} -- needs CUDA and vLLM's CUDA build")
        if args.out or os.environ.get("OUT"):
            _write_json(default_json_path(args.out), {"status": "skipped", "reason": reason})
        return 0

    started = time.time()
    if args.device == "cpu":
        print("development run on CPU against vLLM's CPU ops: these numbers do NOT verify the CUDA profiles")
    engines, unavailable = make_engines(profiles)
    if args.device == "cpu" and not args.plant and "vllm-eager" in engines:
        del engines[
            "vllm-eager"
        ]  # vllm-cpu-eager runs forward_native norms/SiluAndMul, not these C++ kernels
        unavailable["vllm-eager"] = (
            "on CPU torch.ops._C's kernels are not what vllm-cpu-eager runs (forward_native)"
        )
    for name, why in unavailable.items():
        print(f"profile {name}: not checked ({why})")
    checked = _checked_profiles(list(engines), args.device, args.plant)
    with torch.no_grad():
        rows = [] if args.e2e_only else run_cases(engines, args.device, args.quick, args.seed, checked)
        if args.device == "cuda" and not args.e2e_only:
            rows += kernel_rows(args.device, args.quick, args.seed)
    print(format_table(rows))
    errors = sum(r.error is not None for r in rows)
    e2e = _e2e_step(args, profiles)
    moe = None if args.e2e_only else _moe_step(args.device)
    problems = ([] if args.e2e_only else verdict(rows)) + (e2e["problems"] if e2e else [])
    problems += moe["misses"] if moe else []
    if args.e2e_only and e2e is None:
        problems.append("nothing was compared (--e2e-only without the vllm profile)")
    payload = {
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "checked_profiles": checked,
        "status": "ran",
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "vllm": _vllm_version(),
        "sgl_kernel": importlib.util.find_spec("sgl_kernel") is not None,
        "profiles_unavailable": unavailable,
        "seconds": round(time.time() - started, 1),
        "errors": errors,
        "rows": [dataclasses.asdict(r) for r in rows],
        "e2e": e2e,
        "moe": moe,
    }
    _write_json(default_json_path(args.out), payload)
    print(f"{len(rows)} comparisons, {errors} errors, {payload['seconds']} s")
    for line in problems:
        print(f"FAIL {line}")
    print("verdict: " + ("FAIL" if problems else "pass"))
    return 1 if problems else 0


def _add_e2e_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("end-to-end step (the vllm profile, engine's default compiled mode)")
    g.add_argument("--no-e2e", action="store_true", help="skip the end-to-end step")
    g.add_argument("--e2e-only", action="store_true", help="run only the end-to-end step")
    g.add_argument("--e2e-arch", default="qwen3", choices=("qwen2", "qwen3", "llama"))
    g.add_argument("--e2e-prompts", type=int, default=16)
    g.add_argument("--e2e-tokens", type=int, default=32)
    g.add_argument(
        "--e2e-rollouts", default=None, help="reuse this dump of an earlier run instead of sampling"
    )


def _e2e_step(args: argparse.Namespace, profiles: list[str]) -> dict[str, Any] | None:
    """diagnose's pipeline on a tiny model (:mod:`rlalign_verl.diagnose.e2e_check`), or None when not run."""
    if args.no_e2e or "vllm" not in profiles:
        return None
    from rlalign_verl.diagnose.e2e_check import run_e2e

    profile = _checked_profiles(["vllm"], args.device, args.plant)["vllm"]
    out_dir = default_json_path(args.out).parent / "e2e"
    try:
        e2e = run_e2e(args.device, profile, arch=args.e2e_arch, prompts=args.e2e_prompts,
                      tokens=args.e2e_tokens, seed=args.seed, out_dir=out_dir,
                      rollouts_from=Path(args.e2e_rollouts) if args.e2e_rollouts else None)  # fmt: skip
    except Exception as exc:  # a failed step is a miss, reported like a failed case
        traceback.print_exc()
        return {"profile": profile, "rows": {}, "problems": [f"e2e: {type(exc).__name__}: {exc}"]}
    for label, row in e2e["rows"].items():
        lo, hi = row["ci95"]["mismatch/logp_abs_diff_mean"]
        print(
            f"e2e {e2e['arch']} [{profile}] {label:<8} mean |dlogp| {row['mean_abs_dlogp']:.4f} [{lo:.4f}, {hi:.4f}]"
        )
    return e2e


def _moe_step(device: str) -> dict[str, Any] | None:
    """scripts/gpu_moe_check.py's rows and misses at top-k 2 and 8 (CUDA only: it runs vLLM's fused MoE ops, and
    SGLang's where sglang imports: keys ``sglang_top2``/``sglang_top8``)."""
    if device != "cuda":
        return None
    spec = importlib.util.spec_from_file_location(
        "gpu_moe_check", Path(__file__).with_name("gpu_moe_check.py")
    )
    assert spec is not None and spec.loader is not None
    moe_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_check)
    result: dict[str, Any] = {"misses": []}
    for top_k in (2, 8):
        try:
            rows = moe_check.moe_rows(device, top_k=top_k)
        except Exception as exc:  # a step that cannot run is a miss, reported like a failed case
            traceback.print_exc()
            result["misses"].append(f"moe top-{top_k}: {type(exc).__name__}: {exc}")
            continue
        result[f"top{top_k}"] = rows
        result["misses"] += [f"moe top-{top_k}: {m}" for m in moe_check.misses(rows)]
        for name, frac in rows.items():
            print(f"moe top-{top_k} {name:<44} {100 * frac:8.3f}% bit-identical")
    for top_k in (2, 8):  # the sglang profile's MoE data vs SGLang's ops, where sglang imports
        try:
            rows = moe_check.sglang_rows(device, top_k=top_k)
        except Exception as exc:
            traceback.print_exc()
            result["misses"].append(f"moe sglang top-{top_k}: {type(exc).__name__}: {exc}")
            continue
        if rows is None:
            break
        result[f"sglang_top{top_k}"] = rows
        result["misses"] += [f"moe sglang top-{top_k}: {m}" for m in moe_check.sglang_misses(rows)]
        for name, frac in rows.items():
            print(f"moe sglang top-{top_k} {name:<37} {100 * frac:8.3f}% bit-identical")
    return result


def _checked_profiles(engines: list[str], device: str, plant: str | None) -> dict[str, str]:
    """The profile each engine is checked against: its own, its CPU build's (``--device cpu``), or ``plant``."""
    from rlalign_verl.placement import DEVICE_COUNTERPART
    from rlalign_verl.profiles import get_profile

    if plant:
        return dict.fromkeys(engines, get_profile(plant).name)
    return {e: DEVICE_COUNTERPART.get((e, device), e) for e in engines}


if __name__ == "__main__":
    sys.exit(main())
