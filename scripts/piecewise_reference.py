"""An independent reference of one piecewise graph piece, from a profile's rounding fields.

Written from the rounding spec in :mod:`rlalign_verl.catalog.profiles` (not from :mod:`rlalign_verl.align.regions`):
fp32 math with an explicit ``R()`` (round to bf16) at every point a profile field says the engine
rounds, GEMMs in float64 (exact for the selection-matrix checkpoints of :mod:`.piecewise`).

A *middle piece* of vLLM's piecewise graph (split at attention) starts at layer ``i``'s attention
output and the residual that crossed the split, and ends at layer ``i+1``'s q, k, v (after q/k-norm and
RoPE) and the residual that crosses the next split. The *last piece* ends at the final norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlalign_verl.catalog.profiles import EngineProfile, Residual, Source


def R(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 (round-to-nearest-even) and back: the engine storing a bf16 tensor."""
    return x.to(torch.bfloat16).float()


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``R(x @ w.T)`` computed in float64 (exact here: one signed power of two per row of ``w``)."""
    return R((x.double() @ w.double().T).float())


def _rt(v: torch.Tensor, eps: float) -> torch.Tensor:
    var = (v.double() ** 2).mean(-1, keepdim=True).float()  # the correctly rounded fp32 mean of squares
    return torch.rsqrt(var + eps)


def _scale(v: torch.Tensor, rt: torch.Tensor, w: torch.Tensor, roundings: int) -> torch.Tensor:
    # roundings 1: v*rt*w in fp32 (stored by the caller); 2: R(v*rt) first, as eager bf16 ops do
    return v * rt * w.float() if roundings == 1 else R(v * rt) * w.float()


def norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, p: EngineProfile, *, stored: bool = True
) -> torch.Tensor:
    """RMSNorm without residual; ``stored=False``: the value handed on unrounded (inside one graph)."""
    y = _scale(x, _rt(x, eps), w, p.norm.output_roundings)
    return R(y) if stored else y


def add_norm(
    h: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, p: EngineProfile, *, at_split: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm: ``(R(output), residual carried on)``.

    ``at_split``: this add's residual leaves the piece (the norm before attention), else it stays
    inside the piece (the norm after attention). What is carried follows ``p.residual``.
    """
    s = h + res  # fp32 sum of the two incoming values, one fp32 rounding
    rs = R(s)
    var_src = s if p.norm.variance == Source.FP32_SUM else rs
    nrm_src = s if p.norm.normalize == Source.FP32_SUM else rs
    out = R(_scale(nrm_src, _rt(var_src, eps), w, p.norm.output_roundings))
    rounded = p.residual == Residual.EVERY_ADD or (p.residual == Residual.AT_ATTENTION and at_split)
    return out, rs if rounded else s


def rope_table(cache_bf16: torch.Tensor, positions: torch.Tensor, theta: float, d: int, p: EngineProfile):
    """``(cos, sin)`` rows for ``positions``: the engine's bf16 cache, or an fp32 table computed here."""
    if p.rope.table == "bf16":
        c = cache_bf16[positions].float()
        return c[:, : d // 2], c[:, d // 2 :]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.double()[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: EngineProfile) -> torch.Tensor:
    """NeoX rotation of ``x [T, heads, d]`` (fp32 values), stored in bf16."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, None], sin[:, None]
    if p.rope.roundings == 1:
        return torch.cat((R(x1 * c - x2 * s), R(x2 * c + x1 * s)), -1)
    return torch.cat((R(R(x1 * c) - R(x2 * s)), R(R(x2 * c) + R(x1 * s))), -1)


def swiglu(g: torch.Tensor, u: torch.Tensor, p: EngineProfile) -> torch.Tensor:
    """``silu(g) * u`` from bf16 GEMM outputs, stored in bf16."""
    a = torch.nn.functional.silu(g)
    return R(a * u) if p.swiglu.roundings == 1 else R(R(a) * u)


@dataclass
class LayerWeights:
    """One decoder layer's weights (HF names), fp32 copies of the bf16 values."""

    o: torch.Tensor
    post_ln: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    in_ln: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def layer_weights(layer: Any) -> LayerWeights:
    """The weights of a HF decoder layer (Qwen2/Qwen3/Llama)."""
    a, m = layer.self_attn, layer.mlp
    qn = getattr(a, "q_norm", None)
    kn = getattr(a, "k_norm", None)
    f = lambda t: t.detach().float()  # noqa: E731
    return LayerWeights(
        f(a.o_proj.weight), f(layer.post_attention_layernorm.weight), f(m.gate_proj.weight),
        f(m.up_proj.weight), f(m.down_proj.weight), f(layer.input_layernorm.weight), f(a.q_proj.weight),
        f(a.k_proj.weight), f(a.v_proj.weight), f(qn.weight) if qn is not None else None,
        f(kn.weight) if kn is not None else None,
    )  # fmt: skip


def after_attention(attn: torch.Tensor, res: torch.Tensor, w: LayerWeights, eps: float, p: EngineProfile):
    """o_proj, the post-attention add+norm and the MLP: ``(mlp output, residual carried on)``."""
    h = gemm(attn.reshape(attn.shape[0], -1).float(), w.o)
    x, carried = add_norm(h, res.float(), w.post_ln, eps, p, at_split=False)
    return gemm(swiglu(gemm(x, w.gate), gemm(x, w.up), p), w.down), carried


def before_attention(
    h: torch.Tensor, res: torch.Tensor, w: LayerWeights, eps: float, p: EngineProfile, table: tuple, d: int
) -> dict[str, torch.Tensor]:
    """The input add+norm, q/k/v, q/k-norm and RoPE: ``{"q", "k", "v", "residual"}`` leaving the piece."""
    x, carried = add_norm(h, res, w.in_ln, eps, p, at_split=True)
    t = x.shape[0]
    q, k, v = (gemm(x, m).view(t, -1, d) for m in (w.q, w.k, w.v))
    if w.q_norm is not None:
        keep = p.qk_norm_rounded_before_rope
        q = norm(q, w.q_norm, eps, p, stored=keep)
        k = norm(k, w.k_norm, eps, p, stored=keep)
    return {"q": rope(q, *table, p), "k": rope(k, *table, p), "v": v, "residual": carried}


def first_piece(emb: torch.Tensor, w_first: LayerWeights, eps, p, table, d) -> dict:
    """The embedding rows (the first residual, bf16) through layer 0's input norm, q/k/v, q/k-norm, RoPE."""
    x = norm(emb.float(), w_first.in_ln, eps, p)
    t = x.shape[0]
    q, k, v = (gemm(x, m).view(t, -1, d) for m in (w_first.q, w_first.k, w_first.v))
    if w_first.q_norm is not None:
        keep = p.qk_norm_rounded_before_rope
        q = norm(q, w_first.q_norm, eps, p, stored=keep)
        k = norm(k, w_first.k_norm, eps, p, stored=keep)
    return {"q": rope(q, *table, p), "k": rope(k, *table, p), "v": v, "residual": emb.float()}


def middle_piece(attn, res, w_prev: LayerWeights, w_next: LayerWeights, eps, p, table, d) -> dict:
    """Everything between layer ``i``'s attention and layer ``i+1``'s attention."""
    h, carried = after_attention(attn, res, w_prev, eps, p)
    return before_attention(h, carried, w_next, eps, p, table, d)


def last_piece(attn, res, w_last: LayerWeights, final_ln: torch.Tensor, eps, p) -> dict:
    """After the last attention: the final norm's output (the hidden states lm_head reads)."""
    h, carried = after_attention(attn, res, w_last, eps, p)
    out, _ = add_norm(h, carried, final_ln, eps, p, at_split=True)
    return {"hidden": out}
