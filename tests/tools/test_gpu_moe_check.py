"""scripts/gpu_moe_check.py: skips cleanly without CUDA (and its SGLang rows without sglang); its written-down
CUDA formula is a distinct rounding; each block-sum candidate of the SGLang rows gives different bits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_moe_check.py"


@pytest.mark.slow
def test_skips_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("gpu_moe_check: skipped"), out


def test_cuda_doc_formula_differs_from_both_implemented_roundings() -> None:
    spec = importlib.util.spec_from_file_location("gpu_moe_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from rlalign_verl.align.regions.moe import mix_experts, route
    from rlalign_verl.catalog.profiles import CPU_FUSED_MOE, HF

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(4, 128, 128, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(4, 128, 64, generator=g) * 0.1).to(torch.bfloat16)
    w, ids = route((torch.randn(64, 4, generator=g) * 2).to(torch.bfloat16), 2, True, CPU_FUSED_MOE)
    doc = mod.cuda_doc_experts(x, gate_up, down, w.float(), ids)
    for rounding in (HF.moe, CPU_FUSED_MOE):
        other = mix_experts(x, ids, w, gate_up, down, rounding)
        assert 0.2 < (doc == other).float().mean().item() < 0.999


def _load():
    spec = importlib.util.spec_from_file_location("gpu_moe_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_doc_formula_agrees_with_the_profile_data_at_top_2() -> None:
    """Two independent statements of the same source reading (the script's and regions/moe.py's)."""
    from rlalign_verl.align.regions.moe import mix_experts, route
    from rlalign_verl.catalog.profiles import CUDA_TRITON_MOE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(4, 128, 128, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(4, 128, 64, generator=g) * 0.1).to(torch.bfloat16)
    w, ids = route((torch.randn(64, 4, generator=g) * 2).to(torch.bfloat16), 2, True, CUDA_TRITON_MOE)
    doc = _load().cuda_doc_experts(x, gate_up, down, w, ids)
    assert (doc == mix_experts(x, ids, w, gate_up, down, CUDA_TRITON_MOE)).float().mean().item() >= 0.99


def test_every_field_mutation_changes_the_experts_output() -> None:
    """Each mutated field gives different bits on some outputs, so the GPU check can tell it apart."""
    from rlalign_verl.align.regions.moe import mix_experts, route
    from rlalign_verl.catalog.profiles import CUDA_TRITON_MOE

    mod = _load()
    for top_k in (2, 8):
        g = torch.Generator().manual_seed(top_k)
        x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
        gate_up = (torch.randn(16, 128, 128, generator=g) * 0.1).to(torch.bfloat16)
        down = (torch.randn(16, 128, 64, generator=g) * 0.1).to(torch.bfloat16)
        w, ids = route(
            (torch.randn(64, 16, generator=g) * 2).to(torch.bfloat16), top_k, True, CUDA_TRITON_MOE
        )
        muts = mod._mutations(CUDA_TRITON_MOE, top_k)
        assert ("slot_sum_bf16_max_k=8" in muts) == (top_k == 8)
        assert set(muts) >= {
            "profile",
            "expert_gemm=fp32",
            "expert_act_roundings=1",
            "combine=bf16",
            "combine=fp32",
        }
        ref = mix_experts(x, ids, w, gate_up, down, muts.pop("profile"))
        for name, r in muts.items():
            other = mix_experts(x, ids, w if r.weights_dtype == "fp32" else w.bfloat16(), gate_up, down, r)
            assert (other != ref).any(), f"top-{top_k} {name} gives the profile's bits"


def test_misses_name_each_failure() -> None:
    mod = _load()
    good = {
        "router_ids[profile]": 1.0,
        "router_weights[profile]": 0.97,
        "router_weights[router_softmax=topk]": 0.5,
        "experts[profile]": 0.995,
        "experts[combine=bf16]": 0.6,
        "experts[hf]": 0.4,
    }
    assert mod.misses(good) == []
    bad = {**good, "router_ids[profile]": 0.0, "experts[combine=bf16]": 0.999, "experts[profile]": 0.98}
    assert mod.misses(bad) == [
        "router: expert ids differ",
        "experts: 98.000% < 99% bit-identical",
        "experts: experts[combine=bf16] is closer",
    ]


def test_sglang_rows_skip_cleanly_without_sglang(capsys) -> None:
    try:
        import sglang  # noqa: F401
    except ImportError:
        assert _load().sglang_rows("cpu") is None
        assert "sglang rows skipped" in capsys.readouterr().out


def test_block_candidates_are_distinct_and_the_profile_is_the_fused_sum() -> None:
    from rlalign_verl.align.regions.moe import fused_gate_sum

    g = torch.Generator().manual_seed(5)
    x, shared, routed = (torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(3))
    gate_w = (torch.randn(1, 256, generator=g) * 0.05).to(torch.bfloat16)
    cands = _load().block_candidates(x, gate_w, shared, routed)
    assert torch.equal(cands["profile"], fused_gate_sum(x, gate_w, shared, routed))
    assert all(t.dtype == torch.bfloat16 for t in cands.values())
    names = sorted(cands)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert 0.2 < (cands[a] == cands[b]).float().mean().item() < 0.999, (a, b)


def test_sglang_misses_add_the_block_sum() -> None:
    good = {
        "router_ids[profile]": 1.0,
        "router_weights[profile]": 0.97,
        "router_weights[router_softmax=topk]": 0.5,
        "experts[profile]": 0.995,
        "experts[hf]": 0.4,
        "block_sum[profile]": 0.999,
        "block_sum[fp32]": 0.6,
        "block_sum[bf16]": 0.5,
    }
    mod = _load()
    assert mod.sglang_misses(good) == []
    bad = {**good, "block_sum[profile]": 0.9, "block_sum[fp32]": 0.95}
    assert mod.sglang_misses(bad) == [
        "block_sum: 90.000% < 99% bit-identical",
        "block_sum: block_sum[fp32] is closer",
    ]
