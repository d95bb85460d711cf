"""The CUDA (vLLM Triton) MoE rounding, UNVERIFIED data read from source, on CPU.

- ``combine="slot"`` vs an independent float64 statement with explicit ``R()`` (bf16 casts) at exactly the
  points docs/moe.md reads from vLLM's source: bf16 w13 output, ``R(R(silu(g))*u)``, ``R(w_k*d_k)`` per
  slot from the fp32 accumulator, slots summed in bf16 in slot order (top-k <= 4, ``moe_sum_kernel``) or
  in fp32 with one rounding (``at::sum_out``, top-k > 4). float64 vs fp32 accumulation moves a few values
  across a rounding boundary, so >= 99% bit-identical; HF's and the CPU op's roundings must score lower.
- The vllm / vllm-eager profiles carry it with ``verified=False``: without the ``unverified=[moe]`` opt-in an MoE
  model refuses swiglu/moe with one line naming the opt-in and the GPU check; with it the model aligns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlalign_verl.align.regions.moe import mix_experts, route
from rlalign_verl.base.errors import UnsupportedModelError
from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, CUDA_TRITON_MOE, HF, get_profile

BF = torch.bfloat16


def R(t: torch.Tensor) -> torch.Tensor:
    """Round a float64 value to bf16 and back (the only rounding points of the reference)."""
    return t.to(BF).double()


def reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    inter, top_k = down.shape[-1], ids.shape[1]
    slots = []
    for k in range(top_k):
        e = ids[:, k]
        gu = R(torch.einsum("th,tih->ti", x.double(), gate_up[e].double()))
        a = R(R(F.silu(gu[:, :inter])) * gu[:, inter:])
        d = torch.einsum("ti,thi->th", a, down[e].double())
        slots.append(R(weights[:, k, None].double() * d))
    if top_k > 4:
        return R(sum(slots))
    out = slots[0]
    for s in slots[1:]:
        out = R(out + s)
    return out


def _inputs(
    top_k: int, seed: int = 0, tokens: int = 96, hidden: int = 128, inter: int = 64, experts: int = 8
):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * torch.logspace(-1, 1, tokens)[:, None]).to(BF)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(BF)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(BF)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(BF)
    w, ids = route(logits, top_k, True, CUDA_TRITON_MOE)
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("top_k", [2, 3, 6])
def test_slot_combine_matches_the_float64_reading_of_the_source(top_k: int) -> None:
    x, gate_up, down, w, ids = _inputs(top_k)
    ref = reference(x, gate_up, down, w, ids).to(BF)
    same = {
        name: (mix_experts(x, ids, w if r.weights_dtype == "fp32" else w.to(BF), gate_up, down, r) == ref)
        .float()
        .mean()
        .item()
        for name, r in (("cuda", CUDA_TRITON_MOE), ("hf", HF.moe), ("cpu", CPU_FUSED_MOE))
    }
    print(f"top_k={top_k}: bit-identical to the float64+R() reference {same}")
    assert same["cuda"] >= 0.99
    assert same["hf"] < same["cuda"] - 0.05 and same["cpu"] < same["cuda"] - 0.05


def test_the_slot_sum_order_and_mode_are_seen() -> None:
    """Top-k 3: a bf16 running sum differs from an fp32 sum with one rounding on some elements."""
    import dataclasses

    x, gate_up, down, w, ids = _inputs(3, seed=1)
    ours = mix_experts(x, ids, w, gate_up, down, CUDA_TRITON_MOE)
    fp32_sum = mix_experts(
        x, ids, w, gate_up, down, dataclasses.replace(CUDA_TRITON_MOE, slot_sum_bf16_max_k=2)
    )
    assert 0.5 < (ours == fp32_sum).float().mean().item() < 1.0


def test_router_all_experts_fp32_vs_float64() -> None:
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(128, 8, generator=g) * 2).to(BF)
    w, ids = route(logits, 2, True, CUDA_TRITON_MOE)
    assert w.dtype == torch.float32
    p = torch.softmax(logits.double(), -1)
    top = p.topk(2, -1)
    assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values)
    wd = (top.values / top.values.sum(-1, keepdim=True)).gather(1, top.indices.argsort(-1))
    w = w.double().gather(1, ids.argsort(-1))
    assert ((w - wd).abs() / wd).max() < 4 * 2**-24  # fp32 softmax and division: a few fp32 ulps


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager"])
def test_cuda_profiles_need_the_unverified_opt_in(profile: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rlalign_verl.align.patch import apply_alignment, get_alignment

    prof = get_profile(profile)
    assert prof.moe == CUDA_TRITON_MOE and prof.moe.verified is False
    cfg = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=BF).eval()
    with pytest.raises(UnsupportedModelError, match=r"unverified=\('moe',\)") as err:
        apply_alignment(model, regions=("rope", "swiglu", "rmsnorm"), engine=profile)
    assert "\n" not in str(err.value) and "gpu_moe_check.py" in str(err.value)
    apply_alignment(model, regions=("rope", "rmsnorm"), engine=profile)  # dense regions need no opt-in
    apply_alignment(model, regions=("rope", "swiglu", "rmsnorm", "moe"), engine=profile, unverified=("moe",))
    assert get_alignment(model).regions == ("rope", "swiglu", "rmsnorm", "moe")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
