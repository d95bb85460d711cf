"""scripts/gpu_moe_check.py: skips cleanly without CUDA; its written-down CUDA formula is a distinct rounding."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_moe_check.py"


def test_skips_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("gpu_moe_check: skipped"), out


def test_cuda_doc_formula_differs_from_both_implemented_roundings() -> None:
    spec = importlib.util.spec_from_file_location("gpu_moe_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from rlalign_verl.profiles import CPU_FUSED_MOE, HF
    from rlalign_verl.regions.moe import mix_experts, route

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(4, 128, 128, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(4, 128, 64, generator=g) * 0.1).to(torch.bfloat16)
    w, ids = route((torch.randn(64, 4, generator=g) * 2).to(torch.bfloat16), 2, True, CPU_FUSED_MOE)
    doc = mod.cuda_doc_experts(x, gate_up, down, w.float(), ids)
    for rounding in (HF.moe, CPU_FUSED_MOE):
        other = mix_experts(x, ids, w, gate_up, down, rounding)
        assert 0.2 < (doc == other).float().mean().item() < 0.999
