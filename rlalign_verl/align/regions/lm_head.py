"""lm_head region (opt-in): the trainer's logits are computed as the engine's head computes them.

vLLM's ``LogitsProcessor._apply_head`` (``vllm/model_executor/layers/logits_processor.py``) runs the head in
``model_config.head_dtype`` (``--hf-overrides '{"head_dtype": "float32"}'``; SGLang
``--enable-fp32-lm-head``):

* head dtype = model dtype (bf16): the plain bf16 GEMM, i.e. what HF's ``lm_head`` already does: unchanged.
* fp32 on CUDA/ROCm: ``torch.mm(h, W.t(), out_dtype=torch.float32)`` — bf16 operands, fp32 accumulation and
  fp32 logits, no fp32 weight copy.
* fp32 elsewhere (the CPU build): ``F.linear(h.to(fp32), W.to(fp32))`` — the cast path.

:class:`Fp32HeadFn` picks the same path for the profile's device, returns fp32 logits, and saves only the
bf16 ``h`` and ``W`` for backward (the fp32 casts are redone there, never kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlalign_verl.align.regions._precision import autocast_disabled
from rlalign_verl.base.errors import UnsupportedModelError


def _mm_fp32(h2: torch.Tensor, w: torch.Tensor, cuda_path: bool) -> torch.Tensor:
    if cuda_path and h2.is_cuda:
        # vLLM on CUDA/ROCm: torch.mm(out_dtype=fp32), bf16 operands accumulated into fp32 logits
        return torch.mm(h2, w.t(), out_dtype=torch.float32)
    # vLLM elsewhere: F.linear on fp32 casts of both operands
    return F.linear(h2.float(), w.float())


class Fp32HeadFn(torch.autograd.Function):
    """fp32 logits of bf16 ``h [..., H]`` and ``W [V, H]``; backward recomputes the casts (fp32 math)."""

    @staticmethod
    def forward(ctx, h, weight, bias, cuda_path):  # type: ignore[override]
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        with autocast_disabled(h):
            out = _mm_fp32(h.reshape(-1, h.shape[-1]), weight, cuda_path)
            if bias is not None:
                out = out + bias.float()  # vLLM: embedding_bias.to(head_dtype)
        return out.reshape(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        h, weight = ctx.saved_tensors
        with autocast_disabled(grad):
            g = grad.reshape(-1, grad.shape[-1]).float()
            dh = (g @ weight.float()).reshape(h.shape).to(h.dtype)
            dw = (g.t() @ h.reshape(-1, h.shape[-1]).float()).to(weight.dtype)
            db = g.sum(0) if ctx.has_bias else None
        return dh, dw, db, None


def head_forward(cuda_path: bool):
    """A ``forward`` for an ``nn.Linear`` lm_head computing the engine's fp32 logits."""

    def forward(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        return Fp32HeadFn.apply(hidden_states, self.weight, self.bias, cuda_path)

    return forward


def plan(model: nn.Module, family: object, st) -> list[tuple[nn.Module, Callable, tuple]]:
    """The head forward to bind: the ``*ForCausalLM``'s output embedding, when the engine's head is fp32
    (``head_dtype="model"``: HF's bf16 head already is the engine's, nothing to bind)."""
    if st.head_dtype != "float32":
        return []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise UnsupportedModelError(
            f"the lm_head region needs the *ForCausalLM model, not {type(model).__name__}"
        )
    return [(head, head_forward, (st.profile.device == "cuda",))]
