"""``moe_variant="engine-op"``: the MoE experts + combine by vLLM CPU's own ``cpu_fused_moe``.

- forward: bit-identical (100%) to the op as the engine calls it. The reference is built here from vLLM's own
  code, not ours: ``CPUUnquantizedExperts._pad_moe_intermediate`` (or its AMX subclass), ``cpu_prepack_moe_weight``
  and ``cpu_fused_moe`` from ``vllm._custom_ops``, fed the engine router's weights (eager and compiled);
  one shape has an intermediate size that the engine pads.
- backward: exactly the emulated path's gradients (``mix_experts``), finite.
- refusals (no vLLM needed): a non-vllm-cpu profile, swiglu or moe missing, a dense model, an unknown name.
"""

from __future__ import annotations

import pytest
import torch
from moe_engine_reference import MODES
from moe_engine_reference import inputs as _inputs
from moe_engine_reference import route as _route
from moe_engine_reference import vllm_reference as _vllm_reference
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from rlalign_verl.align.engine_ops.moe_op import engine_experts, engine_op_available
from rlalign_verl.align.patch import apply_alignment, get_alignment
from rlalign_verl.align.regions.moe import mix_experts
from rlalign_verl.base.errors import AlignmentError, UnsupportedModelError
from rlalign_verl.catalog.profiles import HF, get_profile

BF = torch.bfloat16
MOE = ("rope", "swiglu", "rmsnorm", "moe")
engine = pytest.mark.skipif(
    not engine_op_available()[0], reason="vLLM's CPU build (cpu_fused_moe) is not installed"
)


# (hidden, intermediate, experts, top-k): the tiny models' widths, another top-k, an intermediate vLLM pads
SHAPES = [(256, 256, 8, 2), (320, 96, 6, 4), (128, 80, 8, 2)]


@engine
@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_experts_bit_identical_to_cpu_fused_moe(profile: str, shape) -> None:
    hidden, inter, n_exp, top_k = shape
    x, gate_up, down, logits = _inputs(hidden + inter, 96, hidden, inter, n_exp)
    weights, w_eng, ids = _route(logits, top_k, profile)
    y_eng = _vllm_reference(x, gate_up, down, w_eng, ids)
    rounding = get_profile(profile).moe
    y_op = engine_experts(x, ids.long(), weights, gate_up, down, rounding)
    y_em = mix_experts(x, ids.long(), weights, gate_up, down, rounding)
    y_hf = mix_experts(x, ids.long(), w_eng.to(BF), gate_up, down, HF.moe)
    emulated, hf = (float((y == y_eng).double().mean()) for y in (y_em, y_hf))
    print(f"\n{profile} {shape}: engine-op 100% bit-identical, emulate {emulated:.5f}, HF math {hf:.3f}")
    assert y_op.dtype == BF and torch.equal(y_op, y_eng)
    assert hf < 0.9  # another rounding is far off: the comparison can fail


@engine
@pytest.mark.parametrize("profile", list(MODES))
def test_gradients_are_the_emulated_paths(profile: str) -> None:
    """Same backward: every input's gradient equals the emulated path's bit for bit, and is finite."""
    x, gate_up, down, logits = _inputs(7, 64, 128, 96, 8)
    weights, _, ids = _route(logits, 2, profile)
    rounding = get_profile(profile).moe
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(BF)
    grads = {}
    for name, fn in (("engine-op", engine_experts), ("emulate", mix_experts)):
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        xx, ww, gu, dd = leaves
        fn(xx, ids.long(), ww, gu, dd, rounding).backward(grad_out)
        grads[name] = [t.grad for t in leaves]
    for a, b in zip(grads["engine-op"], grads["emulate"], strict=True):
        assert a is not None and torch.isfinite(a.float()).all() and torch.equal(a, b)


def _build(kind: str) -> torch.nn.Module:
    common = dict(
        hidden_size=128, intermediate_size=192, moe_intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(head_dim=32, **common)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(shared_expert_intermediate_size=96, **common)
    else:
        cfg = Qwen3Config(
            head_dim=32, **{k: v for k, v in common.items() if "expert" not in k and "moe" not in k}
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=BF)


@engine
@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_aligned_model_runs_the_engines_router_and_op(kind: str, profile: str) -> None:
    """On a model: each sparse block's routing is the engine router's for the block's own logits (weights bit
    for bit, ids in the engine's slot order; compiled: the Inductor-compiled router) and its experts output the
    op's for that routing; loss.backward gives finite gradients; describe() names the variant."""
    from rlalign_verl.tools.diagnose import engine_floor_moe as em

    model = _build(kind)
    apply_alignment(model, regions=MOE, engine=profile, moe_variant="engine-op")
    assert "moe_variant=engine-op" in get_alignment(model).describe()
    seen = []

    @torch.no_grad()
    def check_router(mod, args, out):
        logits, w, ids = out
        w_eng, ids_eng = em.route(logits, mod.top_k, mod.norm_topk_prob, compiled=MODES[profile])
        seen.append(("router", torch.equal(ids, ids_eng.long()) and torch.equal(w.float(), w_eng)))

    @torch.no_grad()
    def check_experts(mod, args, out):
        x, ids, w = args
        ref = _vllm_reference(x, mod.gate_up_proj, mod.down_proj, w.float(), ids.int())
        seen.append(("experts", torch.equal(out, ref)))

    hooks = [
        m.register_forward_hook(check_experts if n.endswith("experts") else check_router)
        for n, m in model.named_modules()
        if n.endswith(("mlp.experts", "mlp.gate"))
    ]
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    assert seen == [("router", True), ("experts", True)] * 2
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0


# --- refusals: one line each, naming the fix; no vLLM needed -------------------------------------------------

REFUSED = {
    # the Python keyword as the caller spells it
    "cuda profile": (dict(engine="vllm", regions=MOE, unverified="moe"), "use moe_variant='emulate'"),
    "sglang": (dict(engine="sglang", regions=("rope", "rmsnorm")), "vllm-cpu profiles only"),
    "hf profile": (dict(engine="hf", regions=MOE), "vllm-cpu profiles only"),
    "moe without swiglu": (dict(engine="vllm-cpu", regions=("rope", "rmsnorm", "moe")), "add swiglu"),
    "swiglu without moe": (dict(engine="vllm-cpu-eager", regions=("swiglu",)), "add moe"),
    "unknown name": (dict(engine="vllm-cpu", regions=MOE, moe_variant="fused"), "use one of"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_settings(case: str) -> None:
    kwargs, fragment = REFUSED[case]
    kwargs = {"moe_variant": "engine-op", **kwargs}
    model = _build("qwen3_moe")
    with pytest.raises(AlignmentError) as e:
        apply_alignment(model, **kwargs)
    assert "\n" not in str(e.value) and fragment in str(e.value), str(e.value)
    assert get_alignment(model) is None


def test_dense_model_is_refused() -> None:
    model = _build("qwen3")
    with pytest.raises(
        UnsupportedModelError, match="needs an MoE model .* not qwen3; use experimental.moe_variant=emulate"
    ):
        apply_alignment(model, regions=MOE, engine="vllm-cpu", moe_variant="engine-op")
    assert get_alignment(model) is None
    # the moe region itself would align nothing on a dense model: refused, not logged as aligned (issue 34)
    with pytest.raises(UnsupportedModelError, match="qwen3 is a dense model .* drop moe from the regions"):
        apply_alignment(model, regions=MOE, engine="vllm-cpu")
    assert get_alignment(model) is None
    apply_alignment(model, regions=MOE[:3], engine="vllm-cpu")
    assert get_alignment(model).moe_variant == "emulate"
