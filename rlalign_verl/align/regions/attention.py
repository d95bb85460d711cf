"""Attention region (opt-in): the trainer's attention rounds as the engine's attention kernel does.

HF's bf16 SDPA rounds its intermediates (scores, probabilities) to bf16 in places the engine does not. The
vLLM CPU build runs ``torch.ops._C.cpu_attention_with_kv_cache`` (``csrc/cpu/cpu_attn*.hpp``): q·k, the
online softmax and p·v accumulate in fp32, and the output is rounded to bf16 once. Two variants:

* ``engine-op`` (default): that very op, called on the training batch laid out as the engine's paged KV
  cache (block size 128, the CPU platform's default), wrapped in an ``autograd.Function`` whose backward
  is fp32 SDPA's (recomputed from the saved bf16 q/k/v; the output rounding is straight-through). Needs
  vLLM's CPU extension in the training process.
* ``sdpa-fp32``: ``F.scaled_dot_product_attention`` on fp32 copies of q/k/v, rounded once: the same
  rounding locations, torch's own blocking (not always the same last bit). No vLLM needed.

Sequences are read from ``position_ids``: a new sequence starts wherever a position does not continue the
previous one (verl's packed remove-padding batches and left-padded rows both qualify; padding tokens
become one-token sequences whose outputs the loss masks anyway). Without ``position_ids`` each batch row
is one sequence.

CUDA and SGLang profiles refuse this region (:func:`rlalign_verl.request.checks.check_attention`): their kernels
(FlashAttention-2/3, FlashInfer) decode with split-KV partial softmaxes merged in an order set by the
batch and the tile layout (``vllm/v1/attention/backends/flash_attn.py`` ``FlashAttentionImpl.forward``
-> ``flash_attn_varlen_func`` with ``num_splits``/``scheduler_metadata``;
``vllm/v1/attention/backends/flashinfer.py`` ``BatchDecodeWithPagedKVCacheWrapper`` /
``BatchPrefillWithPagedKVCacheWrapper``; SGLang ``python/sglang/srt/layers/attention/flashinfer_backend.py``),
so the per-token reduction order of decode differs from any training-side prefill; no verified path exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlalign_verl.align.regions._precision import autocast_disabled
from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.request.spec import ATTENTION_VARIANTS

__all__ = ["ATTENTION_VARIANTS", "aligned_attention", "attention_interface", "sequence_ids"]


def sequence_ids(position_ids: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor:
    """``[batch * seq]`` int64 ids, one per sequence, from where positions stop counting up by one."""
    if position_ids is None:
        return torch.arange(batch).repeat_interleave(seq)
    pos = position_ids.reshape(-1, position_ids.shape[-1]).expand(batch, seq)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return torch.cumsum(starts.reshape(-1).long(), 0) - 1


def segment_lengths(ids: torch.Tensor) -> torch.Tensor:
    return torch.unique_consecutive(ids, return_counts=True)[1]


# --- the fp32 SDPA emulation and the shared backward --------------------------------------------


def _sdpa_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Causal fp32 SDPA per sequence on packed fp32 ``q [N, Hq, D]``, ``k/v [N, Hkv, D]``; returns fp32.

    One-token sequences (padding) attend to themselves only: their output is their ``v``.
    """
    groups = q.shape[1] // k.shape[1]
    out = []
    for seg_q, seg_k, seg_v, n in zip(q.split(lens), k.split(lens), v.split(lens), lens, strict=True):
        if n == 1:
            out.append(seg_v.repeat_interleave(groups, dim=1))
            continue
        o = F.scaled_dot_product_attention(
            seg_q.transpose(0, 1)[None],
            seg_k.transpose(0, 1)[None],
            seg_v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=groups > 1,
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


class AttentionFn(torch.autograd.Function):
    """Forward: the chosen variant, rounded once. Backward: fp32 SDPA's, recomputed from bf16 q/k/v."""

    @staticmethod
    def forward(ctx, q, k, v, ids, scale, kernel):  # type: ignore[override]
        # q [N, Hq, D], k/v [N, Hkv, D] packed tokens -> [N, Hq, D] in q.dtype
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        ctx.lens = segment_lengths(ids).tolist()
        if kernel is not None:  # the engine's own op (engine_ops.attention_op): packed q/k/v, ids, scale
            return kernel(q.contiguous(), k.contiguous(), v.contiguous(), ids, scale)
        with autocast_disabled(q):
            # engine kernels accumulate scores, softmax and p.v in fp32 and round the output once
            return _sdpa_fp32(q.float(), k.float(), v.float(), ctx.lens, scale).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        with torch.enable_grad(), autocast_disabled(grad):
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            o = _sdpa_fp32(qf, kf, vf, ctx.lens, ctx.scale)
            dq, dk, dv = torch.autograd.grad(o, (qf, kf, vf), grad.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def aligned_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor | None,
    scale: float | None,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """Causal attention of HF-layout ``q [B, Hq, T, D]``, ``k/v [B, Hkv, T, D]`` -> ``[B, T, Hq, D]``."""
    b, hq, t, d = q.shape
    if k.shape[2] != t:
        raise AlignmentError(
            "the attention region covers full-sequence training forwards only (no KV cache); "
            "generate without it or drop 'attention' from the regions"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ids = sequence_ids(position_ids, b, t).to(q.device)

    def packed(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    out = AttentionFn.apply(packed(q), packed(k), packed(v), ids, scale, kernel)
    return out.view(b, t, hq, d)


def attention_interface(kernel: Callable | None = None):
    """An HF attention-interface function (``fn(module, q, k, v, mask, **kw) -> (out, None)``): the engine's
    ``kernel`` in forward (the ``engine-op`` variant) or, without one, fp32 SDPA rounded once (``sdpa-fp32``)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return aligned_attention(query, key, value, kwargs.get("position_ids"), scaling, kernel), None

    return attention
