"""The floor for vLLM's piecewise path (the GPU default: Inductor pieces split at attention).

:class:`PiecewiseEngineFloor` runs the same engine ops as :class:`rlalign_verl.tools.diagnose.engine_floor.EngineFloor` (vLLM's native
norms, ``SiluAndMul.forward_native``, ``RotaryEmbedding.forward_static``; HF's own GEMMs, embedding,
attention and lm_head), but compiles them the way vLLM's piecewise backend does: one Inductor graph per
piece, the attention run eagerly between pieces. Whatever a piece returns is stored in its dtype, so the
engine's rounding at the split (the residual leaving the piece before attention) happens here too.

Pieces, as vLLM splits a decoder (``scripts/piecewise_probe.py`` records them in the real engine):
``first`` = embedding .. layer 0's q/k/v; ``middle`` = layer i's o_proj .. layer i+1's q/k/v;
``last`` = the last o_proj .. the final norm. Dense models only.
"""

from __future__ import annotations

import torch

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.tools.diagnose.engine_compile import CPU_INDUCTOR_OPTIONS
from rlalign_verl.tools.diagnose.engine_floor import EngineFloor


class PiecewiseEngineFloor(EngineFloor):
    """``logits(input_ids)`` of a HF Qwen2/Qwen3/Llama with the regions run as vLLM's piecewise graph runs them."""

    def __init__(self, model: torch.nn.Module) -> None:
        if any(hasattr(layer.mlp, "experts") for layer in model.model.layers):
            raise AlignmentError(
                "the piecewise floor covers dense models only; use EngineFloor for MoE models"
            )
        super().__init__(model, compiled=True)
        self.cos_sin_cache = self.cos_sin_cache.to(model.device)  # the table lives where the model runs

        def comp(fn):  # one Inductor graph per piece, the CPU platform's options, token count dynamic
            return torch.compile(fn, backend="inductor", fullgraph=True, options=CPU_INDUCTOR_OPTIONS)

        self._first, self._middle, self._last = (
            comp(self._piece_first),
            comp(self._piece_middle),
            comp(self._piece_last),
        )

    def _after_attention(self, layer, o, residual):
        a = layer.self_attn
        h = self._linear(o, a.o_proj.weight, a.o_proj.bias)
        x, residual = self._norm(h, layer.post_attention_layernorm.weight, residual)
        return self._mlp(layer.mlp, x), residual

    def _piece_first(self, input_ids, positions, layer):
        h = self.model.model.embed_tokens(input_ids)
        x = self._norm(h, layer.input_layernorm.weight)
        return (*self._qkv(layer, x, positions), h)

    def _piece_middle(self, o, residual, positions, prev, nxt):
        h, residual = self._after_attention(prev, o, residual)
        x, residual = self._norm(h, nxt.input_layernorm.weight, residual)
        return (*self._qkv(nxt, x, positions), residual)  # residual leaves the piece: stored in bf16

    def _piece_last(self, o, residual, last):
        h, residual = self._after_attention(last, o, residual)
        out, _ = self._norm(h, self.model.model.norm.weight, residual)
        return out

    def _attention(self, q, k, v):
        t = q.shape[0]
        q4, k4, v4 = (z.view(1, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        return self._sdpa(q4, k4, v4, self.scaling, self.groups).reshape(t, -1)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` bf16 logits of one unpadded sequence of token ids ``[T]``."""
        ids = input_ids.reshape(-1).clone()
        positions = torch.arange(ids.shape[0], dtype=torch.long, device=ids.device)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        layers = self.model.model.layers
        q, k, v, residual = self._first(ids, positions, layers[0])
        for prev, nxt in zip(layers[:-1], layers[1:], strict=True):
            o = self._attention(q, k, v)
            torch._dynamo.mark_dynamic(o, 0)
            torch._dynamo.mark_dynamic(residual, 0)
            q, k, v, residual = self._middle(o, residual, positions, prev, nxt)
        o = self._attention(q, k, v)
        torch._dynamo.mark_dynamic(o, 0)
        torch._dynamo.mark_dynamic(residual, 0)
        return self.model.lm_head(self._last(o, residual, layers[-1]))
