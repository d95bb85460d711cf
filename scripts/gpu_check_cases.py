"""The cases of ``scripts/gpu_profile_check.py``: an engine's op vs our region function on the same inputs.

Each case runs the engine's op (:mod:`gpu_check_engines`) and the region function with the checked
profile's rounding on the same random bf16 inputs and makes one :class:`Row` per output: the fraction of
bit-identical elements and the ULP distance, and for norms, SwiGLU, RoPE, the q/k-norm -> RoPE chain and
the ``vllm`` graph piece the score of every other rounding variant (``best``: the variant closest to the
engine, ties joined by `` = ``). :func:`kernel_rows` compares the optional Triton kernels with the PyTorch
region functions they replace.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlalign_verl.tools.diagnose.bits import bit_identical, compare

if TYPE_CHECKING:
    from gpu_check_engines import Engine

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


# --- region side --------------------------------------------------------------------------------


def _norm_variants(base, with_residual: bool) -> list[tuple[str, Any]]:
    from rlalign_verl.catalog.profiles import Mean, NormRounding, Source

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
    from rlalign_verl.align.regions.rope import apply_rope

    cos, sin = _table_from_cache(cache, pos)
    qh = _to_heads(q if q_fp32 is None else q_fp32, head_size)
    kh = _to_heads(k if k_fp32 is None else k_fp32, head_size)
    qo, ko = apply_rope(qh, kh, cos, sin, rounding, out_dtype=torch.bfloat16)
    return _from_heads(qo), _from_heads(ko)


# --- cases --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One output of one case: the comparison, the variants' scores, the best one, or the error."""

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


def case_rmsnorm(eng: Engine, prof: Any, x: torch.Tensor, w: torch.Tensor, shape: str) -> list[Row]:
    """The engine's RMSNorm vs ours (row ``out``), with every norm variant scored."""
    from rlalign_verl.align.regions.rmsnorm import rms_norm

    def body(rows: list[Row]) -> None:
        eo = eng.rms_norm(x, w, EPS)
        scores = _score_variants(eo, lambda v: rms_norm(x, w, EPS, v), _norm_variants(prof.norm, False))
        _finish(rows[0], eo, rms_norm(x, w, EPS, prof.norm), scores)

    return _guarded("rmsnorm", eng.profile, shape, ("out",), body)


def case_add_rmsnorm(
    eng: Engine, prof: Any, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, shape: str
) -> list[Row]:
    """The engine's fused add + RMSNorm vs ours (rows ``out`` and ``residual``)."""
    from rlalign_verl.align.regions.rmsnorm import add_rms_norm
    from rlalign_verl.catalog.profiles import Residual

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


def case_swiglu(eng: Engine, prof: Any, gu: torch.Tensor, inter: int, shape: str) -> list[Row]:
    """The engine's ``silu_and_mul`` on ``[gate | up]`` vs our SwiGLU (row ``out``)."""
    from rlalign_verl.align.regions._precision import store_as
    from rlalign_verl.align.regions.swiglu import swiglu
    from rlalign_verl.catalog.profiles import SwigluRounding

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


def case_rope(
    eng: Engine,
    prof: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    pos: torch.Tensor,
    cache: torch.Tensor,
    head_size: int,
    shape: str,
) -> list[Row]:
    """The engine's RoPE with its own cos/sin cache vs ours (rows ``q`` and ``k``)."""
    from rlalign_verl.catalog.profiles import RopeRounding

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


def case_qknorm_rope(
    eng: Engine,
    prof: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    pos: torch.Tensor,
    cache: torch.Tensor,
    head_size: int,
    shape: str,
) -> list[Row]:
    """Qwen3: per-head RMSNorm of q/k, then RoPE (is the normalised value rounded in between?)."""
    from rlalign_verl.align.regions.rmsnorm import rms_norm

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


def case_piece(
    eng: Engine,
    prof: Any,
    h1: torch.Tensor,
    r0: torch.Tensor,
    w1: torch.Tensor,
    h2: torch.Tensor,
    w2: torch.Tensor,
    shape: str,
) -> list[Row]:
    """vLLM's compiled piece: post-attention add+norm, then the next input add+norm, residual not stored between."""
    from rlalign_verl.align.regions.rmsnorm import add_rms_norm
    from rlalign_verl.catalog.profiles import Residual

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
    engines: dict[str, Engine],
    device: str,
    quick: bool,
    seed: int,
    checked: dict[str, str] | None = None,
    bundle: Any = None,
) -> list[Row]:
    """Every case for every engine, on fresh random bf16 inputs (``seed``); ``checked`` maps an engine to
    the profile compared with it (default: the engine's own name); ``bundle``: the engines' cos/sin cache
    from the bundle's sources."""
    from rlalign_verl.catalog.profiles import get_profile

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
            if eng.silu_and_mul is not None:
                rows += case_swiglu(eng, prof, gu, inter, f"T={tokens} I={inter} x~{min(2.0 * scale, 4.0):g}")

        for head_size, nq, nkv in ROPE_SHAPES:
            tokens = 300
            cache = _engine_cache(head_size, eng.cache_dtype, device, bundle)
            pos = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
            q, k = randn(tokens, nq * head_size, scale=2.0), randn(tokens, nkv * head_size, scale=2.0)
            shape = f"T={tokens} D={head_size} heads={nq}/{nkv} pos<{MAX_POSITION}"
            rows += case_rope(eng, prof, q, k, pos, cache, head_size, shape)

        if eng.qk_norm_rope is not None:
            head_size, nq, nkv, tokens = 128, 16, 8, 300
            cache = _engine_cache(head_size, eng.cache_dtype, device, bundle)
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

        rows += _table_rows(name, eng, device, bundle)
    return rows


def kernel_rows(device: str, quick: bool, seed: int) -> list[Row]:
    """The optional Triton kernels (rlalign_verl.align.kernels) against the PyTorch region functions they replace."""
    from rlalign_verl.align import kernels
    from rlalign_verl.align.regions._precision import rnd
    from rlalign_verl.align.regions.rope import apply_rope, rope_table
    from rlalign_verl.align.regions.swiglu import swiglu
    from rlalign_verl.catalog.profiles import RopeRounding, SwigluRounding

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


def _engine_cache(head_size: int, dtype: torch.dtype, device: str, bundle: Any = None) -> torch.Tensor:
    """The engine's own cos_sin_cache, built by vLLM's RotaryEmbedding on ``device`` (as at model init).

    vLLM casts the fp32 cache to the model dtype; SGLang keeps it fp32 on CUDA (same formula). With
    ``--bundle``: the same formula from the bundled ``base.py``.
    """
    if bundle is not None:
        return bundle.cos_sin_cache(head_size, MAX_POSITION, ROPE_THETA, dtype)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()), torch.device(device):
        rope = get_rope(head_size, MAX_POSITION, True, {"rope_theta": ROPE_THETA}, torch.bfloat16)
        cache = rope._compute_cos_sin_cache() if dtype == torch.float32 else rope.cos_sin_cache
    return cache.to(device=device, dtype=dtype)


def _table_rows(name: str, eng: Engine, device: str, bundle: Any = None) -> list[Row]:
    """Our table (HF's formula: inv_freq on the CPU, fp32 matmul on ``device``) vs the engine's cache."""
    from rlalign_verl.align.regions.rope import rope_table

    rows = []
    for head_size in (64, 128):
        row = Row("rope_table", name, f"D={head_size} pos<{MAX_POSITION}", "cos|sin")
        try:
            cache = _engine_cache(head_size, eng.cache_dtype, device, bundle)
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
