"""SGLang's CUDA MoE rounding (``SGLANG_TRITON_MOE``, UNVERIFIED data read from sglang 0.5.23), on CPU.

References are written here, independently of ``regions/moe.py``, as float64 math with explicit ``R()`` (bf16)
at exactly the points docs/moe.md reads from SGLang's source:

- experts: bf16 w13 GEMM output (``fused_moe_kernel`` stores ``accumulator.to(compute_type)``), ``R(silu(g)*u)``
  (JIT ``silu_and_mul``, one rounding), ``R(w_k*d_k)`` per slot from the down GEMM's fp32 accumulator
  (``MUL_ROUTED_WEIGHT``), slots combined by ``moe_combine_topk``: top-2 ``torch.add`` of the two bf16 slots,
  top-k > 2 an fp32 sum with one rounding (``moe_sum_reduce``);
- router: ``moe_fused_gate`` softmax over all experts in fp32, top-k, fp32 renormalisation, fp32 weights;
- Qwen2-MoE block: ``fused_gate_sigmoid_mul_add``: ``R(sigmoid(x . w_gate) * shared + routed)``, fp32 inside.

float64 vs fp32 accumulation moves a few values across a rounding boundary (>= 99% bit-identical); the other
profiles' roundings must score clearly lower, so a wrong field value fails. The sglang profile carries it with
``verified=False``: without the opt-in an MoE model refuses swiglu/moe in one line naming it and the GPU check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlalign_verl.align.regions.moe import fused_gate_sum, mix_experts, route
from rlalign_verl.base.errors import UnsupportedModelError
from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, CUDA_TRITON_MOE, HF, SGLANG_TRITON_MOE, get_profile

BF = torch.bfloat16


def R(t: torch.Tensor) -> torch.Tensor:
    """Stored in bf16 (the only rounding points of the references)."""
    return t.to(BF).double()


def reference_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    """SGLang's Triton expert path and ``moe_combine_topk`` in float64 with explicit ``R()``."""
    inter, top_k = down.shape[-1], ids.shape[1]
    slots = []
    for k in range(top_k):
        e = ids[:, k]
        gu = R(torch.einsum("th,tih->ti", x.double(), gate_up[e].double()))  # w13 output stored bf16
        a = R(F.silu(gu[:, :inter]) * gu[:, inter:])  # silu_and_mul: fp32 silu, one rounding
        d = torch.einsum("ti,thi->th", a, down[e].double())  # w2 accumulator, not stored
        slots.append(R(weights[:, k, None].double() * d))  # MUL_ROUTED_WEIGHT, then the bf16 store
    if top_k == 1:
        return slots[0]
    return R(sum(slots))  # top-2: torch.add of two bf16 (exact sum, one rounding); else moe_sum_reduce


def _inputs(
    top_k: int, seed: int = 0, tokens: int = 96, hidden: int = 128, inter: int = 64, experts: int = 10
):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * torch.logspace(-1, 1, tokens)[:, None]).to(BF)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(BF)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(BF)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(BF)
    w, ids = route(logits, top_k, True, SGLANG_TRITON_MOE)
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_experts_match_the_float64_reading_of_the_source(top_k: int) -> None:
    x, gate_up, down, w, ids = _inputs(top_k)
    ref = reference_experts(x, gate_up, down, w, ids).to(BF)
    profiles = (
        ("sglang", SGLANG_TRITON_MOE),
        ("vllm-cuda", CUDA_TRITON_MOE),
        ("hf", HF.moe),
        ("cpu", CPU_FUSED_MOE),
    )
    same = {
        name: (mix_experts(x, ids, w if r.weights_dtype == "fp32" else w.to(BF), gate_up, down, r) == ref)
        .float()
        .mean()
        .item()
        for name, r in profiles
    }
    print(f"top_k={top_k}: bit-identical to the float64+R() reference {same}")
    assert same["sglang"] >= 0.99
    assert max(v for k, v in same.items() if k != "sglang") < same["sglang"] - 0.05


def test_slot_sum_above_top2_is_one_fp32_rounding() -> None:
    """Top-k 3: moe_sum_reduce's fp32 sum differs from vLLM's bf16 running sum (moe_sum_kernel) somewhere."""
    import dataclasses

    x, gate_up, down, w, ids = _inputs(3, seed=1)
    ours = mix_experts(x, ids, w, gate_up, down, SGLANG_TRITON_MOE)
    running = mix_experts(
        x, ids, w, gate_up, down, dataclasses.replace(SGLANG_TRITON_MOE, slot_sum_bf16_max_k=3)
    )
    assert 0.5 < (ours == running).float().mean().item() < 1.0


@pytest.mark.parametrize("renorm", [True, False])
def test_router_fp32_softmax_over_all_experts_vs_float64(renorm: bool) -> None:
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(128, 60, generator=g) * 2).to(BF)  # Qwen1.5-MoE: 60 experts, top-4, no renorm
    w, ids = route(logits, 4, renorm, SGLANG_TRITON_MOE)
    assert w.dtype == torch.float32
    p = torch.softmax(logits.double(), -1)
    top = p.topk(4, -1)
    assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values)
    wd = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
    wd = wd.gather(1, top.indices.argsort(-1))
    got = w.double().gather(1, ids.argsort(-1))
    assert ((got - wd).abs() / wd).max() < 4 * 2**-24  # fp32 softmax and division: a few fp32 ulps


def _block_inputs(seed: int = 7, tokens: int = 128, hidden: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(BF)
    w = (torch.randn(1, hidden, generator=g) * 0.05).to(BF)
    shared = torch.randn(tokens, hidden, generator=g).to(BF)
    routed = torch.randn(tokens, hidden, generator=g).to(BF)
    return x, w, shared, routed


def test_fused_gate_sum_forward_vs_float64() -> None:
    """One rounding from fp32 inputs; HF's per-op roundings and the bf16-logit path score clearly lower."""
    x, w, shared, routed = _block_inputs()
    logit = x.double() @ w.double().t()
    ref = R(torch.sigmoid(logit) * shared.double() + routed.double())
    ours = fused_gate_sum(x, w, shared, routed)
    assert ours.dtype == BF and ours.shape == shared.shape
    hf = R(R(torch.sigmoid(R(logit))) * shared.double()) + routed.double()  # eager ops: each output rounded
    same = {"fused": (ours.double() == ref).float().mean().item(), "hf": (R(hf) == ref).float().mean().item()}
    print(f"fused gate sum bit-identical to the float64+R() reference {same}")
    assert same["fused"] >= 0.999 and same["hf"] < same["fused"] - 0.05


def test_fused_gate_sum_grads_vs_float64() -> None:
    x, w, shared, routed = _block_inputs(seed=8)
    ours = [t.detach().clone().requires_grad_(True) for t in (x, w, shared, routed)]
    theirs = [t.detach().double().requires_grad_(True) for t in (x, w, shared, routed)]
    out = fused_gate_sum(*ours)
    xd, wd, sd, rd = theirs
    ref = torch.sigmoid(xd @ wd.t()) * sd + rd
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(go.to(BF))
    ref.backward(go.double())
    for name, a, b in zip(("x", "w_gate", "shared", "routed"), ours, theirs, strict=True):
        assert a.grad.dtype == BF, name
        err = (a.grad.double() - b.grad).norm() / b.grad.norm()
        assert err < 1e-2, (name, float(err))


def _qwen2_moe():
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=BF)


def test_sglang_profile_needs_the_unverified_opt_in(monkeypatch) -> None:
    from rlalign_verl.align.patch import aligned, apply_alignment, get_alignment, remove_alignment

    prof = get_profile("sglang")
    assert prof.moe == SGLANG_TRITON_MOE and prof.moe.verified is False
    monkeypatch.delenv("RLALIGN_UNVERIFIED", raising=False)
    model = _qwen2_moe().eval()
    for regions in (("swiglu",), ("moe",), ("rope", "swiglu", "rmsnorm")):
        with pytest.raises(
            UnsupportedModelError, match="profile sglang's MoE rounding is read from source"
        ) as err:
            apply_alignment(model, regions=regions, engine="sglang")
        msg = str(err.value)
        assert "\n" not in msg and "gpu_moe_check.py on a GPU with sglang installed" in msg
        assert get_alignment(model) is None
    apply_alignment(model, regions=("rope", "rmsnorm"), engine="sglang")  # dense regions need no opt-in
    remove_alignment(model)
    block = type(model.model.layers[0].mlp).__name__
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with aligned(model, regions=("rope", "moe"), engine="sglang", unverified=("moe",)):
        # "fused" needs only moe (its output is bf16), unlike "fp32" which needs rmsnorm too
        assert block in {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
    model.train()
    with aligned(model, regions=("rope", "swiglu", "rmsnorm", "moe"), engine="sglang", unverified=("moe",)):
        assert get_alignment(model).unverified == ("moe",)
        out = model(ids, output_hidden_states=True)
        assert all(h.dtype == BF for h in out.hidden_states) and torch.isfinite(out.logits).all()
        F.cross_entropy(out.logits.float().flatten(0, 1), ids.flatten()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert model.model.layers[0].mlp.shared_expert_gate.weight.grad is not None
        assert grads and all(torch.isfinite(g).all() for g in grads)
    assert block not in {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
