"""apply_alignment on tiny in-memory Qwen3-MoE / Qwen2-MoE models: exactness, patching contract, gradients.

References are independent of the code under test: HF's own unpatched forward (the ``hf`` profile must
reproduce it bit for bit) and a float64 re-statement of the expert/router math written here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from rlalign_verl.align.patch import aligned, apply_alignment, get_alignment, remove_alignment
from rlalign_verl.align.regions.moe import mix_experts, route
from rlalign_verl.base.errors import UnsupportedModelError
from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, CUDA_TRITON_MOE, HF, MoeRounding

BF = torch.bfloat16
ALL = ("rope", "swiglu", "rmsnorm")


def config(kind: str, **overrides):
    common = dict(
        hidden_size=96, intermediate_size=160, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa",
        mlp_only_layers=[1],
    )  # fmt: skip
    common.update(overrides)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=32, **common)
    return Qwen2MoeConfig(shared_expert_intermediate_size=80, **common)


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides), dtype=BF)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.5 if "gate.weight" in name else 0.08)  # a spread-out router
    return model.eval()


IDS = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(0))
KINDS = ("qwen3_moe", "qwen2_moe")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def bound(model) -> set[str]:
    """Modules with an aligned forward (not the pass-throughs every decoder layer and base model get)."""
    from rlalign_verl.align.binding import AlignedForward, passthrough_forward

    def aligned(fwd) -> bool:
        func = getattr(fwd, "func", None)
        return not (isinstance(func, AlignedForward) and func.factory is passthrough_forward)

    return {type(m).__name__ for m in model.modules() if "forward" in m.__dict__ and aligned(m.forward)}


@pytest.mark.parametrize("kind", KINDS)
def test_hf_profile_is_bit_identical_to_unpatched(kind: str) -> None:
    model = build(kind)
    ref = logits(model)
    with aligned(model, regions=ALL, engine="hf"):
        assert "Qwen3MoeExperts" in bound(model) or "Qwen2MoeExperts" in bound(model)
        out = logits(model)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_cpu_changes_numbers_and_removal_restores(kind: str) -> None:
    model = build(kind)
    ref = logits(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_alignment(model, regions=ALL, engine="vllm-cpu")
    apply_alignment(model, regions=ALL, engine="vllm-cpu")  # idempotent
    assert get_alignment(model).regions == ALL
    out = logits(model)
    assert not torch.equal(out, ref)
    assert (out.float() - ref.float()).abs().max() < 1.0  # same model, other rounding
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    remove_alignment(model)
    assert bound(model) == set()
    assert torch.equal(logits(model), ref)


def test_swiglu_region_alone_changes_only_the_experts_and_mlps() -> None:
    model = build("qwen3_moe")
    with aligned(model, regions=("swiglu",), engine="vllm-cpu"):
        assert bound(model) == {"Qwen3MoeExperts", "Qwen3MoeMLP"}


def test_moe_region_binds_the_router_and_changes_the_routing_weights() -> None:
    model = build("qwen3_moe")
    with aligned(model, regions=ALL, engine="vllm-cpu-eager"):
        base = logits(model)
        assert "Qwen3MoeTopKRouter" not in bound(model)
    with aligned(model, regions=(*ALL, "moe"), engine="vllm-cpu-eager"):
        assert {"Qwen3MoeTopKRouter", "Qwen3MoeExperts"} <= bound(model)
        assert get_alignment(model).regions == (*ALL, "moe")
        with_moe = logits(model)
    assert not torch.equal(with_moe, base)


def test_all_excludes_the_opt_in_moe_region() -> None:
    from rlalign_verl.request.regions import normalize_regions

    assert normalize_regions("all") == ALL
    assert normalize_regions("all,moe") == (*ALL, "moe")
    assert normalize_regions(["moe", "rope"]) == ("rope", "moe")


@pytest.mark.parametrize("regions", [("swiglu",), ("moe",)])
def test_profile_without_moe_rounding_is_refused_for_experts(regions) -> None:
    """A profile with no MoE data (every built-in one has some now: a copy of sglang without it)."""
    import dataclasses

    from rlalign_verl.catalog.profiles import get_profile

    bare = dataclasses.replace(get_profile("sglang"), moe=None)
    model = build("qwen2_moe")
    with pytest.raises(UnsupportedModelError, match="no MoE expert/router rounding yet .*vllm-cpu") as err:
        apply_alignment(model, regions=regions, engine=bare, unverified=("moe",))
    assert "\n" not in str(err.value)
    apply_alignment(model, regions=("rope", "rmsnorm"), engine=bare)  # the dense regions still work
    assert get_alignment(model).regions == ("rope", "rmsnorm")


@pytest.mark.parametrize(
    "overrides",
    [{"scoring_func": "sigmoid"}, {"n_group": 4, "topk_group": 2}, {"routed_scaling_factor": 2.5}],
)
def test_unsupported_router_is_one_line_error(overrides) -> None:
    model = build("qwen3_moe")
    for k, v in overrides.items():
        setattr(model.config, k, v)
    with pytest.raises(UnsupportedModelError, match="softmax top-k routing only") as err:
        apply_alignment(model, regions=ALL, engine="vllm-cpu")
    assert "\n" not in str(err.value)
    assert bound(model) == set()


# --- the expert / router functions vs float64 statements of the same math ------------------------


def _expert_inputs(seed: int = 0, tokens: int = 40, hidden: int = 64, inter: int = 32, experts: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(BF)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(BF)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(BF)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(BF)
    return x, gate_up, down, logits


def _reference64(x, gate_up, down, weights, experts):
    """sum_k w_k * down(silu(g) * u) in float64, no rounding anywhere."""
    inter = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(experts.shape[1]):
        e = experts[:, k]
        gu = torch.einsum("th,tih->ti", x.double(), gate_up[e].double())
        a = F.silu(gu[:, :inter]) * gu[:, inter:]
        out += weights[:, k, None].double() * torch.einsum("ti,thi->th", a, down[e].double())
    return out


@pytest.mark.parametrize(
    "rounding", [HF.moe, CPU_FUSED_MOE, CUDA_TRITON_MOE], ids=["hf", "cpu_fused_moe", "cuda_triton_slot"]
)
def test_mix_experts_forward_and_grads_vs_float64(rounding: MoeRounding) -> None:
    x, gate_up, down, logits = _expert_inputs()
    weights, experts = route(logits, 2, True, rounding)
    xs, gu, dn, w = (t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, weights))
    out = mix_experts(xs, experts, w, gu, dn, rounding)
    xd, gud, dnd, wd = (t.detach().double().requires_grad_(True) for t in (x, gate_up, down, weights))
    ref = _reference64(xd, gud, dnd, wd, experts)
    scale = ref.abs().max()
    assert (out.double() - ref).abs().max() / scale < 2e-2  # a few bf16 roundings
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(go.to(BF))
    ref.backward(go.double())
    for ours, theirs in ((xs, xd), (gu, gud), (dn, dnd), (w, wd)):
        err = (ours.grad.double() - theirs.grad).norm() / theirs.grad.norm()
        assert err < 2e-2, err


def test_fp32_expert_math_is_closer_to_float64_than_hf() -> None:
    """The fused (fp32) expert path rounds fewer times: it must be nearer the exact value (can fail if
    the rounding fields were swapped or ignored)."""
    x, gate_up, down, logits = _expert_inputs(seed=3, tokens=256)
    weights, experts = route(logits, 2, True, HF.moe)
    ref = _reference64(x, gate_up, down, weights, experts)
    err = {
        name: (mix_experts(x, experts, weights, gate_up, down, r).double() - ref).abs().mean().item()
        # nearest stores: truncation (vLLM's CPU kernels without AVX512-BF16) is biased, not fewer roundings
        for name, r in (("hf", HF.moe), ("fused", dataclasses.replace(CPU_FUSED_MOE, store="nearest")))
    }
    assert err["fused"] < 0.7 * err["hf"], err


@pytest.mark.parametrize("rounding", [HF.moe, CPU_FUSED_MOE], ids=["hf", "cpu_router"])
def test_route_weights_and_grads_vs_float64(rounding: MoeRounding) -> None:
    _, _, _, logits = _expert_inputs(seed=5, tokens=64)
    lg = logits.detach().clone().requires_grad_(True)
    w, idx = route(lg, 2, True, rounding)
    assert torch.equal(idx.sort(-1).values, logits.float().topk(2, -1).indices.sort(-1).values)
    ld = logits.detach().double().requires_grad_(True)
    wd = torch.softmax(ld.gather(1, idx), dim=-1)  # renormalised top-k = softmax over the k logits
    assert w.dtype == BF
    assert (w.double() - wd).abs().max() <= 2**-8
    go = torch.randn(w.shape, generator=torch.Generator().manual_seed(2))
    w.backward(go.to(BF))
    wd.backward(go.double())
    assert (lg.grad.double() - ld.grad).norm() / ld.grad.norm() < 2e-2


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_norm_applies_on_moe_models(kind: str) -> None:
    """compiled_norm is verified on both MoE families (the engine's stored-sum norms read from its Inductor code;
    exact end to end on the real engine): it binds, and the norms it builds follow the family's MLP output reads."""
    model = build(kind)
    apply_alignment(model, engine="vllm-cpu", compiled_norm=True)
    assert get_alignment(model).spec.experimental.compiled_norm
    remove_alignment(model)
    assert get_alignment(model) is None


def test_qwen2_moe_fp32_block_sum_trains_and_is_removed() -> None:
    """``vllm-cpu`` (block_sum="fp32"): the sparse blocks are bound, hidden states stay bf16, gradients are finite
    and close to HF's (a few bf16 roundings apart: 5% relative), and removal restores the block's own forward."""
    model = build("qwen2_moe").train()
    block = type(model.model.layers[0].mlp).__name__

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(IDS, output_hidden_states=True)
        assert all(h.dtype == BF for h in out.hidden_states)
        F.cross_entropy(out.logits.float().flatten(0, 1), IDS.flatten()).backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    with aligned(model, regions=(*ALL, "moe"), engine="vllm-cpu"):
        assert block == "Qwen2MoeSparseMoeBlock" and block in bound(model)
        got = grads()
    assert block not in bound(model)
    assert got.keys() == ref.keys()
    num = sum((got[n] - ref[n]).norm() ** 2 for n in ref) ** 0.5
    den = sum(ref[n].norm() ** 2 for n in ref) ** 0.5
    print(f"\n[qwen2_moe vllm-cpu all+moe] grad rel. diff vs HF {float(num / den):.4f}")
    assert torch.isfinite(num) and num / den < 0.05
