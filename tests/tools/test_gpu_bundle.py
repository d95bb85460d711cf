"""The GPU bundle (scripts/gpu_bundle.py) and what of the device check runs without a GPU, with no network.

The builder runs against synthetic sdists served by a loopback PyPI JSON API (tests/support/
gpu_bundle_fixtures.py): the include closure, the manifest, every refusal (one line, exit 2), the offline
rerun and verify(). The parts that read the real bundle (./gpu_bundle, made by ``python scripts/
gpu_bundle.py``) skip without it: our binding's op schemas against vLLM's, the native-op loader and one
Inductor compile of a loaded op on CPU. The MoE router rows and the check's bundle-mode arguments run on CPU.
The device command (scripts/gpu_device_check.sh) refuses a missing or changed bundle in one line before
building anything, and the `run` call docs/gpu-check.md gives fits the device's limits.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_bundle_fixtures import (
    FI_UNRELATED,
    ROOT,
    UNRELATED,
    VLLM_EXTERNAL,
    VLLM_REACHED,
    FakeIndex,
    fi_files,
    load_script,
    vllm_files,
)

gb = load_script("gpu_bundle")
REAL_BUNDLE = ROOT / "gpu_bundle"
needs_bundle = pytest.mark.skipif(
    not (REAL_BUNDLE / "MANIFEST.json").is_file(),
    reason="no ./gpu_bundle (make it: python scripts/gpu_bundle.py)",
)


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A loopback index serving synthetic vLLM 0.31.0 and FlashInfer 0.3.1 sdists; an empty cache."""
    monkeypatch.setenv("RLALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RLALIGN_PYPI_INDEX", raising=False)
    with FakeIndex() as idx:
        idx.vllm_tar = idx.add("vllm", "0.31.0", "vllm-0.31.0", vllm_files(gb.VLLM_SPEC["files"]))
        fi = fi_files(gb.FLASHINFER_SPEC["files"])
        idx.fi_tar = idx.add("flashinfer_python", "0.3.1", "flashinfer_python-0.3.1", fi, project_only=True)
        yield idx


def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = gb.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- the builder -----------------------------------------------------------------------------------------


def test_bundle_holds_the_include_closure_and_a_true_manifest(index: FakeIndex, tmp_path: Path) -> None:
    out = tmp_path / "gpu_bundle"
    m = gb.build(out, index=index.url)
    vllm = {e["path"].split("/", 1)[1] for e in m["files"] if e["source"] == "vllm"}
    want = set(gb.VLLM_SPEC["seeds"]) | VLLM_REACHED | set(gb.VLLM_SPEC["files"])
    assert vllm == want  # headers followed through ../, the include root and a conditional #include
    assert not vllm & set(UNRELATED)  # nothing reached by no seed, commented-out includes not followed
    assert set(m["vllm"]["external_includes"]) == VLLM_EXTERNAL
    fi = {e["path"].split("/", 1)[1] for e in m["files"] if e["source"] == "flashinfer"}
    assert "include/flashinfer/utils.cuh" in fi and "csrc/pytorch_extension_utils.h" in fi
    assert not fi & set(FI_UNRELATED)
    # versions, sdist provenance, every file's sha256 and size, the totals
    assert (m["vllm"]["version"], m["flashinfer"]["version"]) == (gb.VLLM_VERSION, gb.FLASHINFER_VERSION)
    assert m["vllm"]["sdist_sha256"] == hashlib.sha256(index.vllm_tar).hexdigest()
    assert m["flashinfer"]["sdist_sha256"] == hashlib.sha256(index.fi_tar).hexdigest()
    assert m["vllm"]["sdist_size"] == len(index.vllm_tar) and "absent" in m["sgl_kernel"]
    sources = {**vllm_files(gb.VLLM_SPEC["files"])}
    for e in m["files"]:
        data = (out / e["path"]).read_bytes()
        assert e["sha256"] == hashlib.sha256(data).hexdigest() and e["size"] == len(data)
        if e["source"] == "vllm":
            assert data == sources[e["path"].split("/", 1)[1]]  # byte-identical to the sdist
    assert m["file_count"] == len(m["files"]) == len(vllm) + len(fi)
    assert m["total_bytes"] == sum(e["size"] for e in m["files"])
    on_disk = json.loads((out / "MANIFEST.json").read_text())
    assert on_disk["files"] == m["files"] and on_disk["kind"] == gb.KIND
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "gpu_bundle"]  # no temporary folder left
    assert gb.verify(out) == []


def test_rerun_is_offline_from_the_cache(index: FakeIndex, tmp_path: Path, capsys) -> None:
    out = tmp_path / "b"
    first = gb.build(out, index=index.url)
    index.__exit__(None, None, None)  # the index is gone: a rerun must not need it
    rc, stdout, err = _main(capsys, "--out", str(out), "--index", index.url)
    assert rc == 0, err
    assert stdout.startswith(f"gpu_bundle: wrote {out} (") and err == ""
    again = json.loads((out / "MANIFEST.json").read_text())
    assert again["files"] == first["files"] and gb.verify(out) == []


def test_a_changed_cached_sdist_is_downloaded_again(index: FakeIndex, tmp_path: Path) -> None:
    gb.build(tmp_path / "b", index=index.url)
    cached = gb.sdist.cache_dir() / "vllm-0.31.0.tar.gz"
    cached.write_bytes(b"truncated")
    gb.build(tmp_path / "b", index=index.url)
    assert cached.read_bytes() == index.vllm_tar
    assert index.requests.count("/files/vllm-0.31.0.tar.gz") == 2


def test_sha256_mismatch_is_refused_in_one_line(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("RLALIGN_CACHE", str(tmp_path / "cache"))
    with FakeIndex() as idx:
        idx.add("vllm", "0.31.0", "vllm-0.31.0", vllm_files(gb.VLLM_SPEC["files"]), sha256="0" * 64)
        out = tmp_path / "b"
        rc, stdout, err = _main(capsys, "--out", str(out), "--index", idx.url, "--no-flashinfer")
    line = _one_line(err)
    assert rc == 2 and stdout == ""
    assert line.startswith("gpu_bundle: refused: vllm-0.31.0.tar.gz: sha256 ") and "0" * 64 in line
    assert not out.exists() and not (gb.sdist.cache_dir() / "vllm-0.31.0.tar.gz").exists()


def test_a_version_the_index_lacks_is_refused(index: FakeIndex, tmp_path: Path, capsys) -> None:
    rc, _, err = _main(capsys, "--out", str(tmp_path / "b"), "--index", index.url, "--vllm-version", "9.9.9")
    assert rc == 2 and "vllm 9.9.9 is not on the index" in _one_line(err) and "no such release" in err
    rc, _, err = _main(
        capsys, "--out", str(tmp_path / "b"), "--index", index.url, "--flashinfer-version", "0.0.1"
    )
    assert rc == 2 and "flashinfer_python 0.0.1 is not on the index" in _one_line(err)
    assert not (tmp_path / "b").exists()


def test_a_bundle_over_the_size_limit_is_refused(index: FakeIndex, tmp_path: Path, capsys) -> None:
    out = tmp_path / "b"
    rc, _, err = _main(capsys, "--out", str(out), "--index", index.url, "--max-bytes", "100")
    line = _one_line(err)
    assert rc == 2 and re.search(r"the bundle is \d+ B, over the 100 B it may take", line), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert gb.bundle_limit(10 * 2**20) == gb.CARRY_LIMIT - 10 * 2**20 - gb.MARGIN  # the carry limit


def test_an_existing_folder_that_is_not_a_bundle_is_kept(index: FakeIndex, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc, _, err = _main(capsys, "--out", str(out), "--index", index.url)
    assert rc == 2 and "is not a GPU bundle" in _one_line(err) and "not overwriting" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_verify_finds_a_changed_missing_or_extra_file(index: FakeIndex, tmp_path: Path, capsys) -> None:
    out = tmp_path / "b"
    m = gb.build(out, index=index.url)
    first = out / m["files"][0]["path"]
    first.write_bytes(first.read_bytes().replace(b"#", b"/"))  # same size, other bytes
    second = out / m["files"][1]["path"]
    second.unlink()
    (out / "vllm-0.31.0" / "extra.h").write_text("")
    assert gb.verify(out) == [
        f"changed {m['files'][0]['path']}",
        f"missing {m['files'][1]['path']}",
        "not in the manifest: vllm-0.31.0/extra.h",
    ]
    rc, _, err = _main(capsys, "--verify", str(out))
    assert rc == 2 and "3 problem(s), first: changed" in _one_line(err)
    assert gb.verify(tmp_path / "none") == [f"{tmp_path / 'none'}: no such folder"]


# --- versions and schemas --------------------------------------------------------------------------------


def test_the_bundled_versions_are_the_ones_the_cuda_profiles_claim() -> None:
    from rlalign_verl.catalog.profiles import PROFILES

    claimed: set[str] = set()
    for p in PROFILES.values():
        if p.engine == "vllm" and p.device == "cuda":
            text = " ".join((p.verified, *p.sources, *(str(v) for v in p.verified_on)))
            claimed |= set(re.findall(r"\bvllm(?:-cpu)? (\d+\.\d+\.\d+)", text))
    assert claimed == {gb.VLLM_VERSION}
    sglang = PROFILES["sglang"].verified
    assert re.findall(r"FlashInfer bc29697b = v(\d+\.\d+\.\d+)", sglang) == [gb.FLASHINFER_VERSION]


@needs_bundle
def test_our_binding_declares_vllms_own_op_schemas(tmp_path: Path) -> None:
    build = load_script("gpu_bundle_build")
    bundle = build.open_bundle(REAL_BUNDLE)
    assert bundle.vllm_version == gb.VLLM_VERSION
    assert build.schema_mismatches(bundle) == []
    text = build.BINDING.read_text()
    assert set(re.findall(r'ops\.impl\("(\w+)"', text)) == set(build.OPS)  # every op registered for CUDA
    for old, new in (
        ("float epsilon", "float eps"),
        ("Tensor!? key", "Tensor? key"),
        ("double epsilon", "float epsilon"),
    ):
        changed = tmp_path / "binding.cpp"
        changed.write_text(text.replace(old, new, 1))
        assert build.schema_mismatches(bundle, changed), old


# --- the native ops and their compile path, on CPU -------------------------------------------------------


@pytest.fixture(scope="module")
def natives():
    nat = load_script("gpu_bundle_natives")
    return nat, nat.load_natives(load_script("gpu_bundle_build").open_bundle(REAL_BUNDLE))


@needs_bundle
def test_native_ops_load_from_the_bundle_and_round_as_vllm_cpu_eager(natives) -> None:
    from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
    from rlalign_verl.align.regions.swiglu import swiglu
    from rlalign_verl.catalog.profiles import SwigluRounding, get_profile

    _, n = natives
    assert n.sources["rms_norm"].startswith("vllm/ir/ops/layernorm.py:")
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 256, generator=g) * 3).bfloat16(), torch.randn(5, 256, generator=g).bfloat16()
    w = (torch.randn(256, generator=g) * 0.2 + 1).bfloat16()
    prof = get_profile("vllm-cpu-eager").norm  # vLLM's forward_native run eagerly
    assert torch.equal(n.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, prof))
    y, res = n.fused_add_rms_norm(x, r, w, 1e-6)
    oy, ores = add_rms_norm(x, r, w, 1e-6, prof, round_residual=True)
    assert torch.equal(y, oy) and torch.equal(res, ores.to(res.dtype))
    gu = (torch.randn(5, 512, generator=g) * 2).bfloat16()
    assert torch.equal(n.silu_and_mul(gu), swiglu(gu[:, :256], gu[:, 256:], SwigluRounding(2)))
    cache = n.cos_sin_cache(64, 128, 10000.0)
    assert cache.shape == (128, 64) and cache.dtype == torch.float32
    q, k = torch.randn(5, 4 * 64).bfloat16(), torch.randn(5, 2 * 64).bfloat16()
    qo, ko = n.rotary_forward_static(torch.arange(5), q, k, 64, 64, cache.bfloat16(), True)
    assert qo.shape == q.shape and ko.shape == k.shape and torch.equal(qo[0], q[0])  # position 0: identity


@needs_bundle
def test_the_loader_refuses_a_function_needing_what_it_lacks(tmp_path: Path) -> None:
    nat = load_script("gpu_bundle_natives")
    root = tmp_path / "vllm-0.31.0"
    for rel, _ in nat.NATIVE_SOURCES.values():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REAL_BUNDLE / "vllm-0.31.0" / rel, dest)
    layernorm = root / "vllm/ir/ops/layernorm.py"
    layernorm.write_text(
        layernorm.read_text().replace("orig_dtype = x.dtype", "orig_dtype = current_platform.dtype", 1)
    )
    fake = type("B", (), {"vllm_root": root})()
    with pytest.raises(nat.BundleError, match=r"layernorm.py:\d+ rms_norm needs \['current_platform'\]"):
        nat.load_natives(fake)
    layernorm.write_text("def other():\n    pass\n")
    with pytest.raises(nat.BundleError, match="no rms_norm"):
        nat.load_natives(fake)


@needs_bundle
def test_vllms_settings_are_anchored_in_the_bundled_sources(tmp_path: Path) -> None:
    nat = load_script("gpu_bundle_natives")
    bundle = load_script("gpu_bundle_build").open_bundle(REAL_BUNDLE)
    assert nat.check_anchors(bundle) == []
    opts = nat.inductor_options("cuda", "2.11.0+cu130")
    assert opts == nat.CUDA_INDUCTOR_OPTIONS and opts["combo_kernels"] is True
    assert not set(nat.ASSERT_KEYS) & set(
        nat.inductor_options("cuda", "2.12.0")
    )  # torch >= 2.12: torch's own
    import torch._inductor.config as inductor_config

    assert all(hasattr(inductor_config, k) for k in opts)  # every key is an Inductor option
    fake = type("B", (), {"vllm_root": tmp_path})()
    for rel in nat.ANCHORS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(
            (bundle.vllm_root / rel).read_text().replace('"combo_kernels"] = True', "")
        )
    assert nat.check_anchors(fake) == [
        "vllm/config/compilation.py: 'self.inductor_compile_config[\"combo_kernels\"] = True' not found"
    ]


@needs_bundle
def test_the_bundled_natives_compile_with_inductor_and_match_the_cpu_profile(natives) -> None:
    """The check's compiled engine on the bundle's sources with vLLM's CPU options: its row passes against
    vllm-cpu; a planted wrong profile (hf: two output roundings) is a miss naming the right variant."""
    from rlalign_verl.catalog.profiles import get_profile

    nat, n = natives
    engines, cases = load_script("gpu_check_engines"), load_script("gpu_check_cases")
    eng = engines._vllm_compiled_engine(nat.natives_functions(n), nat.inductor_options("cpu"))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 896, generator=g).bfloat16(), (torch.randn(896, generator=g) * 0.2 + 1).bfloat16()
    row = cases.case_rmsnorm(eng, get_profile("vllm-cpu"), x, w, "T=7")[0]
    assert (
        row.error is None
        and row.result["identical"] >= 0.999
        and row.best[1] - row.result["identical"] < 1e-6
    )
    planted = cases.case_rmsnorm(eng, get_profile("hf"), x, w, "T=7")[0]
    assert planted.best[0].startswith("out1/") and planted.best[1] > planted.result["identical"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
@needs_bundle
def test_the_bundled_python_sources_are_the_installed_vllms() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    installed = Path(spec.origin).parent.parent
    m = json.loads((REAL_BUNDLE / "MANIFEST.json").read_text())
    py = [e for e in m["files"] if e["source"] == "vllm" and e["path"].endswith(".py")]
    assert len(py) >= 8
    for e in py:
        rel = e["path"].split("/", 1)[1]
        assert hashlib.sha256((installed / rel).read_bytes()).hexdigest() == e["sha256"], rel


def test_moe_router_rows_name_the_closer_router() -> None:
    """The router rows call topk_softmax as fused_topk does and name ``router_softmax=topk`` when it is closer
    (here a CPU stand-in of the kernel's contract: outputs written in place, fp32 weights, int32 ids)."""
    from types import SimpleNamespace

    e2e = load_script("gpu_bundle_e2e")

    class Router:
        def __init__(self, topk_first: bool) -> None:
            self.topk_first = topk_first

        def topk_softmax(self, w, ids, tok, logits, renormalize, bias, is_padding) -> None:
            assert w.dtype == torch.float32 and ids.dtype == tok.dtype == torch.int32 and bias is None
            k = w.shape[1]
            if self.topk_first:
                vals, idx = logits.float().topk(k, dim=-1)
                p = vals.softmax(-1)
            else:
                p, idx = logits.float().softmax(-1).topk(k, dim=-1)
                p = p / p.sum(-1, keepdim=True) if renormalize else p
            w.copy_(p)
            ids.copy_(idx)
            tok.copy_(idx)

    rows = e2e.router_rows(SimpleNamespace(device="cpu", ops=Router(False)), 16, 2, True)
    assert rows["router_ids[profile]"] == 1.0 and rows["router_weights[profile]"] == 1.0
    assert e2e.router_misses(rows) == []
    rows = e2e.router_rows(SimpleNamespace(device="cpu", ops=Router(True)), 16, 2, True)
    assert e2e.router_misses(rows) == ["router: best variant router_softmax=topk is closer"]
    step = e2e.moe_step(SimpleNamespace(device="cpu", ops=Router(True)))
    assert {k for k in step if k.startswith("router_")} == {
        "router_e16_top2",
        "router_e60_top4",
        "router_e128_top8",
    }
    assert step["experts"].startswith("absent: ") and step["misses"]
    assert e2e.moe_step(SimpleNamespace(device="cpu", ops=None)) is None


# --- the device command ----------------------------------------------------------------------------------


def _device(tmp_path: Path, bundle: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_BUNDLE": str(bundle), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_device_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_device_command_refuses_a_missing_or_changed_bundle(index: FakeIndex, tmp_path: Path) -> None:
    proc = _device(tmp_path, tmp_path / "absent")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no such folder" in _one_line(proc.stderr) and "python scripts/gpu_bundle.py" in proc.stderr
    bundle = tmp_path / "b"
    m = gb.build(bundle, index=index.url)
    (bundle / m["files"][-1]["path"]).write_text("changed")
    proc = _device(tmp_path, bundle)
    assert proc.returncode == 2 and f"changed {m['files'][-1]['path']}" in _one_line(proc.stderr)
    assert not (tmp_path / "out").exists()  # refused before anything was built or written


def test_the_check_in_bundle_mode_refuses_a_missing_bundle_and_bad_arguments(tmp_path: Path, capsys) -> None:
    check = load_script("gpu_profile_check")
    assert check.main(["--bundle", str(tmp_path / "absent"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "absent: not a usable bundle" in _one_line(err) and check.BUNDLE is None
    with pytest.raises(SystemExit) as exc:
        check.main(["--bundle", "gpu_bundle", "--e2e-rollouts", "x.jsonl", "--device", "cpu"])
    assert exc.value.code == 2 and "--e2e-rollouts cannot be used with --bundle" in capsys.readouterr().err


def test_the_summary_names_every_miss_with_its_best_variant(tmp_path: Path) -> None:
    summary = load_script("gpu_check_summary")

    def row(region: str, own: float, best: tuple[str, float] | None) -> dict:
        return {"region": region, "profile": "vllm", "shape": "T=7", "output": "out", "error": None,
                "result": {"identical": own, "max_ulp": 1}, "best": list(best) if best else None}  # fmt: skip

    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"status": "ran", "verdict": "pass", "problems": [],
                              "rows": [row("rmsnorm", 1.0, ("out1/mean", 1.0))]}))  # fmt: skip
    text, passed = summary.summarize([ok])
    assert passed and "rmsnorm      vllm" in text and "MISS" not in text and text.endswith("gpu check: pass")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"status": "ran", "verdict": "fail", "problems": ["swiglu/vllm/T=7/out: ..."],
                               "rows": [row("swiglu", 0.5, ("r2", 1.0))]}))  # fmt: skip
    text, passed = summary.summarize([ok, bad, tmp_path / "timed_out.json"])
    assert not passed and "MISS best: r2 (100.000%)" in text and "FAIL swiglu/vllm/T=7/out" in text
    assert "FAIL no report" in text and summary.main([str(ok)]) == 0 and summary.main([str(bad)]) == 1


def test_the_documented_run_call_fits_the_device_limits() -> None:
    """docs/gpu-check.md's `run` call: a command of at most 2,000 characters that runs the device script,
    the bundle as the only carried path (git-ignored), a timeout inside the 10-minute limit; with the bundle
    here, its size beside the working tree is under the 64 MiB a call carries."""
    doc = (ROOT / "docs" / "gpu-check.md").read_text()
    call = json.loads(re.search(r"```json\n(\{.*?\})\n```", doc, re.S).group(1))
    assert set(call) == {"command", "carry", "timeout_s"}
    assert len(call["command"]) <= 2000 and "scripts/gpu_device_check.sh" in call["command"]
    assert call["carry"] == ["gpu_bundle"] and call["timeout_s"] <= 600
    ignored = subprocess.run(["git", "check-ignore", "-q", "gpu_bundle/MANIFEST.json"], cwd=ROOT)
    assert ignored.returncode == 0, "gpu_bundle/ must be git-ignored (it travels only as a carried path)"
    if (REAL_BUNDLE / "MANIFEST.json").is_file():
        size = sum(p.stat().st_size for p in REAL_BUNDLE.rglob("*") if p.is_file())
        assert size + gb.tree_bytes() <= gb.CARRY_LIMIT
