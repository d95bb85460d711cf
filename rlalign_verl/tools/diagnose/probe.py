"""Bit-level comparison of two tensors (the one ULP helper) and the op-level probe of ``diagnose``.

The helpers are pure torch: tests and ``scripts/gpu_profile_check.py`` import them too. The probe
runs each region function, with every profile, against the installed engine's own op (both CPU
paths) on random inputs of the model's shapes; it imports vLLM (through :mod:`.engine_ops`).
"""

from __future__ import annotations

from typing import Any

import torch

from rlalign_verl.tools.diagnose.bits import compare, merge


def _inputs(model: Any, seed: int, tokens: int) -> dict[str, Any]:
    """Random bf16 inputs of the model's shapes, rows spanning 3.5 decades of magnitude."""
    cfg, bf = model.config, torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    attn = model.model.layers[0].self_attn
    hd = attn.head_dim
    scale = torch.logspace(-2, 1.5, tokens)[:, None]
    rand = lambda *shape, s=3.0: (torch.randn(*shape, generator=gen) * s).to(bf)  # noqa: E731
    h = (torch.randn(tokens, cfg.hidden_size, generator=gen) * scale).to(bf)
    r = (torch.randn(tokens, cfg.hidden_size, generator=gen) * scale * 4).to(bf)
    g, u = rand(tokens, cfg.intermediate_size), rand(tokens, cfg.intermediate_size)
    far = torch.randint(0, int(cfg.max_position_embeddings), (tokens - tokens // 2,), generator=gen)
    pos = torch.cat([torch.arange(tokens // 2), far])
    q = rand(tokens, cfg.num_attention_heads * hd)
    k = rand(tokens, cfg.num_key_value_heads * hd)
    qk_norm = getattr(attn, "q_norm", None)
    w_qk = qk_norm.weight.detach() if qk_norm is not None else None
    return dict(h=h, r=r, w=model.model.norm.weight.detach(), g=g, u=u, pos=pos, q=q, k=k, hd=hd, w_qk=w_qk)


def _engine_outputs(model: Any, x: dict[str, Any], compiled: bool) -> dict[str, Any]:
    from rlalign_verl.tools.diagnose import engine_floor as eo

    eps, t, hd = float(model.config.rms_norm_eps), x["q"].shape[0], x["hd"]
    rope = eo.rope_for_config(model.config, hd, x["q"].dtype)
    return {
        "plain": eo.rms_norm(x["h"], x["w"], eps, compiled=compiled),
        "fused": eo.rms_norm(x["h"], x["w"], eps, residual=x["r"], compiled=compiled)[0],
        "qk": None
        if x["w_qk"] is None
        else eo.rms_norm(x["q"].view(t, -1, hd), x["w_qk"], eps, compiled=compiled),
        "act": eo.silu_and_mul(x["g"], x["u"], compiled=compiled),
        "rope": eo.apply_rope_module(rope, x["pos"], x["q"], x["k"], compiled=compiled),
    }


def _ours(model: Any, x: dict[str, Any], prof: Any, eng: dict[str, Any]) -> dict[str, Any]:
    from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
    from rlalign_verl.align.regions.rope import apply_rope, rope_table
    from rlalign_verl.align.regions.swiglu import swiglu

    eps, t, hd = float(model.config.rms_norm_eps), x["q"].shape[0], x["hd"]
    parts = [
        compare(eng["plain"], rms_norm(x["h"], x["w"], eps, prof.norm)),
        compare(eng["fused"], add_rms_norm(x["h"], x["r"], x["w"], eps, prof.norm, round_residual=True)[0]),
    ]
    if eng["qk"] is not None:
        parts.append(compare(eng["qk"], rms_norm(x["q"].view(t, -1, hd), x["w_qk"], eps, prof.norm)))
    rot = model.model.rotary_emb
    cos, sin = rope_table(rot.inv_freq, x["pos"][None], getattr(rot, "attention_scaling", 1.0))
    if prof.rope.table != "fp32":
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    q4, k4 = (v.view(1, t, -1, hd).transpose(1, 2) for v in (x["q"], x["k"]))
    try:
        q_us, k_us = (v.transpose(1, 2).reshape(t, -1) for v in apply_rope(q4, k4, cos, sin, prof.rope))
        rope = merge([compare(eng["rope"][0], q_us), compare(eng["rope"][1], k_us)])
    except ValueError as e:  # a profile the rope function refuses
        rope = {
            "n": 0,
            "identical": float("nan"),
            "differing": 0,
            "max_ulp": -1,
            "mean_ulp": 0.0,
            "error": str(e),
        }
    act = compare(eng["act"], swiglu(x["g"], x["u"], prof.swiglu))
    return {"rope": rope, "swiglu": act, "rmsnorm": merge(parts)}


def op_probe(model: Any, *, seed: int = 0, tokens: int = 64) -> dict[str, Any]:
    """Each region function, for every profile, vs the engine's op in both CPU modes, on model shapes.

    Returns ``{"modes": {mode: {profile: {region: compare-dict}}}, "recommended": {mode: profile},
    "tokens": n}`` and, for MoE models, ``"moe": {mode: {profile: {"router"|"experts": compare-dict}}}``
    (:mod:`.probe_moe`); ``mode`` is ``"eager"`` (enforce_eager) or ``"compiled"`` (the CPU default).
    """
    from rlalign_verl.catalog.profiles import PROFILES
    from rlalign_verl.tools.diagnose.probe_moe import moe_probe

    x = _inputs(model, seed, tokens)
    modes: dict[str, dict[str, Any]] = {}
    moe: dict[str, Any] = {}  # MoE models: router and experts rows (profiles with an MoE rounding)
    for mode, compiled in (("eager", False), ("compiled", True)):
        eng = _engine_outputs(model, x, compiled)
        modes[mode] = {name: _ours(model, x, prof, eng) for name, prof in PROFILES.items()}
        if (rows := moe_probe(model, x["h"], compiled)) is not None:
            moe[mode] = rows
    own = {"eager": "vllm-cpu-eager", "compiled": "vllm-cpu"}
    recommended = {
        # highest worst-region identity; ties go to the profile written for this path
        mode: max(
            per, key=lambda p, m=mode, per=per: (min(v["identical"] for v in per[p].values()), p == own[m])
        )
        for mode, per in modes.items()
    }
    return {"modes": modes, "recommended": recommended, "tokens": tokens, **({"moe": moe} if moe else {})}
