"""The installed vLLM CPU build's own MoE ops, callable on plain tensors (ground truth for the MoE rows).

- :func:`route`: ``CPURouter``'s softmax top-k (``fused_moe/router/cpu_router.py::_softmax_topk``),
  eagerly (``enforce_eager=True``) or through Inductor with the CPU platform's options (the default
  path traces the router into the whole-model graph: on CPU ``MoERunner._select_forward`` calls the
  forward directly, not the opaque ``torch.ops.vllm.moe_forward``), compiled as in that graph: the token
  count dynamic, experts and top-k static (checked against the real engine's weights: docs/moe.md).
- :func:`fused_experts`: ``torch.ops._C.cpu_fused_moe`` on prepacked weights, the op
  ``CPUUnquantizedExperts.apply`` calls (an opaque custom op on both paths), with the ISA the engine picks
  (``amx`` where AMX tiles are usable, else ``vec``).

Import-heavy (imports vLLM): import only where the engine is wanted.
"""

from __future__ import annotations

import torch

from rlalign_verl.tools.diagnose.engine_compile import compiled_fn


def cpu_isa() -> str:
    """The ISA vLLM's CPU experts use here: ``amx`` (X86CPUUnquantizedExperts) or ``vec``."""
    from rlalign_verl.align.engine_ops.moe_op import engine_isa

    return engine_isa()


@torch.no_grad()
def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 [T, k], topk_ids int32 [T, k])`` as the engine's CPU router computes them."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    if not compiled:
        return _softmax_topk(logits, top_k, renormalize)
    n = logits.shape[0]
    x = torch.cat((logits, logits[:1])) if n < 2 else logits.clone()  # no size-1 specialisation
    torch._dynamo.mark_dynamic(x, 0)  # the token count is the engine graph's only dynamic size
    w, ids = _compiled_router(logits.shape[-1], logits.dtype, top_k, renormalize)(x)
    return w[:n], ids[:n]


_ROUTERS: dict[tuple, object] = {}


def _compiled_router(experts: int, dtype: torch.dtype, top_k: int, renormalize: bool):
    """``_softmax_topk`` compiled as inside the engine's graph: top-k and renormalisation are constants of the
    graph, experts static, one Dynamo cache per variant (so no earlier variant makes a size dynamic: with
    every size dynamic Inductor writes another kernel, e.g. 86-91% of the weights at 8 experts unrenormalised)."""
    import types

    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    from rlalign_verl.tools.diagnose.engine_compile import CPU_INDUCTOR_OPTIONS

    key = (experts, dtype, top_k, renormalize)
    if key not in _ROUTERS:

        def router(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _softmax_topk(logits, top_k, renormalize)

        code = router.__code__.replace(co_name=f"router_{abs(hash(key)):x}")
        fn = types.FunctionType(code, router.__globals__, code.co_name, None, router.__closure__)
        _ROUTERS[key] = torch.compile(fn, backend="inductor", fullgraph=True, options=CPU_INDUCTOR_OPTIONS)
    return _ROUTERS[key]


@torch.no_grad()
def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """``cpu_fused_moe`` on ``x [T, H]`` with HF-layout weights (``gate_up [E, 2I, H]``, ``down [E, H, I]``)."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    isa = isa or cpu_isa()
    out = torch.empty_like(x)
    cpu_fused_moe(
        out,
        x.contiguous(),
        cpu_prepack_moe_weight(gate_up.contiguous(), isa),
        cpu_prepack_moe_weight(down.contiguous(), isa),
        None,
        None,
        weights.float().contiguous(),
        experts.to(torch.int32).contiguous(),
        "silu",
        isa,
    )
    return out


# --- the floor's MoE block: the engine's router and expert op, HF's matmuls ------------------------

_FUSED_OP: dict[str, object] = {}


def _fused_op():
    """``rlalign::cpu_fused_moe``: the engine's expert op (prepacked weights), opaque to Dynamo/Inductor
    as in the engine, returning a fresh tensor."""
    if _FUSED_OP:
        return _FUSED_OP["op"]

    @torch.library.custom_op("rlalign::cpu_fused_moe", mutates_args=())
    def op(
        x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, isa: str
    ) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None, w, ids, False, "silu", isa)
        return out

    @op.register_fake
    def _(x, w13, w2, w, ids, isa):
        return torch.empty_like(x)

    _FUSED_OP["op"] = op
    return op


def prepare_floor_experts(model: torch.nn.Module, tp: int = 1) -> str:
    """Prepack every sparse block's expert weights for ``cpu_fused_moe`` (once, outside any compiled code,
    as the engine does after loading): at tensor parallel ``tp`` each rank's slice
    (:func:`rlalign_verl.align.regions.moe.rank_experts`), its intermediate dimension padded as the engine pads it
    (``_pad_moe_intermediate``); returns the ISA."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    from rlalign_verl.align.engine_ops.moe_op import pad_intermediate
    from rlalign_verl.align.regions.moe import rank_experts

    isa = cpu_isa()
    for m in model.modules():
        if hasattr(m, "experts") and hasattr(m, "gate") and "_rlalign_floor_ranks" not in m.__dict__:
            gate_up, down = m.experts.gate_up_proj.detach(), m.experts.down_proj.detach()
            ranks = []
            for r in range(tp):
                w13, w2 = pad_intermediate(*rank_experts(gate_up, down, r, tp))
                ranks.append((cpu_prepack_moe_weight(w13, isa), cpu_prepack_moe_weight(w2, isa)))
            m.__dict__["_rlalign_floor_ranks"] = ranks
    _fused_op()
    return isa


def floor_experts(floor, m, x: torch.Tensor) -> torch.Tensor:
    """An HF sparse MoE block as vLLM's CPU build runs it: ``GateLinear`` (bf16 logits), ``CPURouter``
    softmax top-k (traced into the graph when compiled), ``cpu_fused_moe`` (per rank at TP > 1); Qwen2-MoE adds its
    shared expert ``sigmoid(gate(x)) * mlp(x)`` (``Qwen2MoeMLP.forward``, vllm/model_executor/models/qwen2_moe.py)
    to the routed output, at TP > 1 rank by rank (its ``down_proj`` has ``reduce_results=False``); then the
    engine's all-reduce of the ranks' sums (``moe_runner._maybe_reduce_final_output``)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    lin, rp = floor._linear, floor.row_parallel
    logits = lin(x, m.gate.weight, None)
    w, ids = _softmax_topk(logits, m.gate.top_k, m.gate.norm_topk_prob)
    parts = [_fused_op()(x, w13, w2, w, ids, floor.moe_isa) for w13, w2 in m._rlalign_floor_ranks]
    shared = getattr(m, "shared_expert", None)
    if shared is not None:
        gate = torch.sigmoid(lin(x, m.shared_expert_gate.weight, None))
        if len(parts) == 1:
            shares = [floor._mlp(shared, x)]
        else:
            shares = rp.parts(lin, floor._mlp_act(shared, x), shared.down_proj.weight, None)
        parts = [gate * s + p for s, p in zip(shares, parts, strict=True)]
    return parts[0] if len(parts) == 1 else rp.reduce(parts, rp.truncate)


def _shared_sum_norm(gate, shared, routed, residual, weight, eps):
    from torch.nn import functional as F

    from rlalign_verl.tools.diagnose.engine_compile import native_op

    # vLLM models/qwen2_moe.py::Qwen2MoeMLP.forward (F.sigmoid(expert_gate(x)) * out), then
    # MoERunner: shared_output + fused_output, then the next layer's fused add + RMSNorm
    h = F.sigmoid(gate) * shared + routed
    return native_op("fused_add_rms_norm")(h, residual, weight, eps)


@torch.no_grad()
def shared_sum_norm(
    gate: torch.Tensor,
    shared: torch.Tensor,
    routed: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    compiled: bool = False,
) -> torch.Tensor:
    """The next norm's output after Qwen2-MoE's ``sigmoid(gate) * shared + routed`` as the engine runs it."""
    fn = compiled_fn(_shared_sum_norm) if compiled else _shared_sum_norm
    return fn(gate, shared, routed, residual.clone(), weight, eps)[0]
