"""The attribution ladder of ``diagnose`` and the engine head dtype option.

The expected shares, counts and statements are worked out by hand below, not by the code under test.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import get_profile
from rlalign_verl.tools.cli import main as cli_main
from rlalign_verl.tools.diagnose.head import engine_hf_overrides, sample_head_dtype
from rlalign_verl.tools.diagnose.ladder import HEAD_NOTE, ladder_rows, plan, zero_count
from rlalign_verl.tools.diagnose.rollouts import Rollout, RolloutHeader, write_rollouts

MEAN = "mismatch/logp_abs_diff_mean"


def test_share_is_what_the_rung_removes_of_what_the_previous_left():
    # two prompts, two tokens each. Rung 0: mean (0.4+0.4+0.2+0.2)/4 = 0.3. Rung 1 keeps a quarter of
    # every prompt's gap: mean 0.075, share (0.3-0.075)/0.3 = 0.75 in every bootstrap draw.
    rows = ladder_rows(["a", "b"], [[0.4, 0.4, 0.2, 0.2], [0.1, 0.1, 0.05, 0.05]], [2, 2], [0, 1])
    assert rows[0]["mean"] == pytest.approx(0.3, abs=1e-15) and "share" not in rows[0]
    assert rows[1]["mean"] == pytest.approx(0.075, abs=1e-15)
    assert rows[1]["share"] == pytest.approx(0.75, abs=1e-12)
    assert rows[1]["share_ci95"] == pytest.approx([0.75, 0.75], abs=1e-12)
    assert rows[1]["share_text"] == "removes 75% [75%, 75%] of what the previous rung left"
    assert rows[0]["ci95"][0] <= 0.3 <= rows[0]["ci95"][1]


def test_a_rung_that_makes_it_worse_says_adds():
    # 0.1 -> 0.15 on both prompts: share (0.1-0.15)/0.1 = -0.5
    rows = ladder_rows(["a", "b"], [[0.1, 0.1], [0.15, 0.15]], [1, 1], [0, 1])
    assert rows[1]["share"] == pytest.approx(-0.5, abs=1e-12)
    assert rows[1]["share_text"].startswith("adds 50% [50%, 50%]")


def test_share_inside_the_noise_is_not_claimed():
    # per prompt 1.0 everywhere, then 1.5/0.5 alternating: same mean (share 0), but resampled prompts
    # move the share both ways, so its interval holds 0
    rows = ladder_rows(["a", "b"], [[1.0] * 8, [1.5, 0.5] * 4], [1] * 8, list(range(8)))
    assert rows[1]["share"] == pytest.approx(0.0, abs=1e-12)
    lo, hi = rows[1]["share_ci95"]
    assert lo < 0 < hi
    assert rows[1]["share_text"].startswith("within noise")
    assert "removes" not in rows[1]["share_text"] and "adds" not in rows[1]["share_text"]


def test_exact_zero_counts_and_statements():
    assert zero_count([0.0, 1e-30, 0.0, -0.0, 2.0]) == 3
    rows = ladder_rows(
        ["a", "b", "c", "d"],
        [[0.2, 0.0, 0.1, 0.3], [0.0, 0.3, 0.0, 0.0], [0.0] * 4, [0.0] * 4],
        [2, 2],
        [0, 1],
    )
    assert [r["exact_zero"] for r in rows] == [1, 3, 4, 4] and all(r["tokens"] == 4 for r in rows)
    assert "exactly_zero" not in rows[0] and "exactly_zero" not in rows[1]
    assert rows[2]["exactly_zero"] == "gap is exactly zero (4/4 tokens with Δlogp = 0)"
    assert rows[2]["share"] == 1.0 and rows[2]["share_text"].startswith("removes 100% [100%, 100%]")
    assert rows[3]["share"] is None and rows[3]["share_text"].startswith("nothing left to remove")


def test_a_share_just_short_of_all_is_not_rounded_to_all():
    # 1.0 -> 0.0001 on both prompts: share 0.9999, shown as 99.99%
    rows = ladder_rows(["a", "b"], [[1.0, 1.0], [1e-4, 1e-4]], [1, 1], [0, 1])
    assert rows[1]["share_text"].startswith("removes 99.99% [99.99%, 99.99%]")


def test_identical_rungs_say_no_change():
    rows = ladder_rows(["a", "b"], [[0.1, 0.2], [0.1, 0.2]], [1, 1], [0, 1])
    assert rows[1]["share"] == 0.0 and rows[1]["share_text"].startswith("no change")


def _step(steps, name: str):
    return next(step for step in steps if step[0].name == name)


def test_plan_skips_what_cannot_run_and_builds_on_what_ran():
    three = ("rope", "swiglu", "rmsnorm")
    cpu = plan(get_profile("vllm-cpu"), "model")
    assert [(r.name, regs) for r, regs, _, _ in cpu] == [
        ("none", ()),
        ("rope+swiglu+rmsnorm", three),
        ("+ attention", (*three, "attention")),
        ("+ tp", None),
        ("+ lm_head", None),
        ("+ engine-compiled norm", (*three, "attention")),
        ("+ moe, engine MoE op", None),
    ]
    assert _step(cpu, "+ moe, engine MoE op")[3] == "dense model: no routed experts"
    assert _step(cpu, "+ tp")[3] == "the rollouts ran at tensor parallel 1: no all-reduce to mirror"
    assert _step(cpu, "+ engine-compiled norm")[2] == {"compiled_norm": True} and cpu[2][2] == {}
    eager = plan(get_profile("vllm-cpu-eager"), "float32")
    assert _step(eager, "+ lm_head")[1] == (*three, "attention", "lm_head")
    assert _step(eager, "+ engine-compiled norm")[1] is None
    assert "does not compile its norms" in _step(eager, "+ engine-compiled norm")[3]
    assert _step(cpu, "+ lm_head")[3] == HEAD_NOTE and "--engine-head-dtype float32" in HEAD_NOTE
    cuda = plan(get_profile("vllm"), "float32")
    assert cuda[2][1] is None and "cannot be aligned to profile 'vllm'" in cuda[2][3]
    assert _step(cuda, "+ lm_head")[1] == (*three, "lm_head") and _step(cuda, "+ lm_head")[3] is None
    tp2 = plan(get_profile("vllm-cpu"), "model", tp=2)
    assert _step(tp2, "+ tp")[1] == (*three, "attention", "tp")
    assert _step(tp2, "+ engine-compiled norm")[1] == (*three, "attention", "tp")


def test_plan_on_moe_models_adds_the_engine_moe_op():
    """MoE: the compiled norms are measured (verified on both families); the last rung adds moe with
    moe_variant=engine-op on the vLLM CPU profiles (where vLLM's op is callable) and is skipped, with the reason,
    elsewhere."""
    from rlalign_verl.align.engine_ops.moe_op import engine_op_available

    four = ("rope", "swiglu", "rmsnorm", "attention")
    cpu = plan(get_profile("vllm-cpu"), "model", moe=True, model_type="qwen2_moe")
    for model_type, tp in (("qwen3_moe", 1), ("qwen2_moe", 1), ("qwen2_moe", 2)):
        measured = _step(
            plan(get_profile("vllm-cpu"), "model", True, tp, model_type), "+ engine-compiled norm"
        )
        assert measured[1] is not None and measured[2] == {"compiled_norm": True} and measured[3] is None
    moe = _step(cpu, "+ moe, engine MoE op")
    if engine_op_available()[0]:
        assert (
            moe[1] == (*four[:3], "moe", "attention")
            and moe[2]
            == {"compiled_norm": True, "moe_variant": "engine-op"}  # cumulative: + the compiled norms
            and moe[3] is None
        )
    cuda = _step(plan(get_profile("vllm"), "float32", moe=True), "+ moe, engine MoE op")
    assert cuda[1] is None and "vllm-cpu profiles only" in cuda[3]


def _header(extra=None) -> SimpleNamespace:
    return SimpleNamespace(extra=extra or {})


def test_head_dtype_sources():
    cfg, cfg_fp32 = SimpleNamespace(), SimpleNamespace(head_dtype="float32")
    recorded = _header({"hf_overrides": {"head_dtype": "float32"}})
    assert sample_head_dtype(recorded, cfg, None, "dump")[0] == "float32"
    assert sample_head_dtype(recorded, cfg, "fp32", "dump")[0] == "float32"
    with pytest.raises(AlignmentError, match="drop --engine-head-dtype"):
        sample_head_dtype(recorded, cfg, "model", "dump")
    assert sample_head_dtype(_header(), cfg, "float32", "dump") == ("float32", "--engine-head-dtype")
    assert sample_head_dtype(_header(), cfg_fp32, None, "dump")[0] == "float32"
    assert sample_head_dtype(_header(), cfg, None, "dump")[0] == "model"
    assert engine_hf_overrides("float32") == {"head_dtype": "float32"}
    assert engine_hf_overrides("model") == {} and engine_hf_overrides(None) == {}


def _tripwire(monkeypatch):
    import rlalign_verl.tools.diagnose.runner as runner

    def boom(*a, **k):
        raise AssertionError("the engine started before the bad option was refused")

    monkeypatch.setattr(runner, "run_engine_jobs", boom)


def test_bad_head_dtype_refused_before_the_engine(monkeypatch, capsys, tmp_path):
    _tripwire(monkeypatch)
    assert cli_main(["diagnose", "--engine-head-dtype", "fp16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine-head-dtype float32" in err


def test_attention_setting_refused_for_a_cuda_dump(tiny_checkpoint, capsys, tmp_path):
    model = tiny_checkpoint("qwen2")
    header = RolloutHeader(
        "vllm", "0.31.0", "compiled", str(model), "bfloat16", 0, {"temperature": 1.0}, "vllm"
    )
    dump = tmp_path / "d.jsonl"
    write_rollouts(dump, header, [Rollout([10, 11], [5, 6], [-1.0, -0.5], None)])
    argv = ["diagnose", "--rollout-logprobs", str(dump), "--model", str(model), "--out", str(tmp_path / "o")]
    assert cli_main([*argv, "--settings", "none,all+attention"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be aligned to profile 'vllm'" in err


@pytest.mark.engine
def test_ladder_on_engine_rollouts(engine_rollouts, tmp_path, capsys):
    """Eager engine dump: the ladder reuses the settings' numbers and the attention rung adds exact tokens."""
    er = engine_rollouts("qwen2", "eager")
    dump = tmp_path / "dump.jsonl"
    shutil.copy(er.path, dump)
    out = tmp_path / "out"
    argv = ["diagnose", "--rollout-logprobs", str(dump), "--model", str(er.model_dir), "--out", str(out)]
    assert cli_main([*argv, "--settings", "none,all", "--no-probe", "--no-plots", "--no-floor"]) == 0
    res = json.loads((out / "diagnose.json").read_text())
    rows = res["ladder"]["rows"]
    names = ["none", "rope+swiglu+rmsnorm", "+ attention", "+ tp", "+ lm_head", "+ engine-compiled norm"]
    assert [r["rung"] for r in rows] == [*names, "+ moe, engine MoE op"]
    assert rows[0]["mean"] == pytest.approx(res["settings"]["none"][MEAN], rel=1e-5)
    assert rows[1]["mean"] == pytest.approx(res["settings"]["all"][MEAN], rel=1e-5)
    assert rows[0]["tokens"] == 32 * 32
    assert rows[2]["exact_zero"] > rows[1]["exact_zero"] and rows[2]["mean"] < rows[1]["mean"]
    assert rows[3] == {
        "rung": "+ tp",
        "skipped": "the rollouts ran at tensor parallel 1: no all-reduce to mirror",
    }
    assert rows[4] == {"rung": "+ lm_head", "skipped": HEAD_NOTE}
    assert "does not compile its norms" in rows[5]["skipped"]  # the eager path
    assert rows[6] == {"rung": "+ moe, engine MoE op", "skipped": "dense model: no routed experts"}
    assert res["engine"]["head_dtype"] == "model"
    assert "attribution ladder" in capsys.readouterr().out


def test_engine_job_passes_hf_overrides_to_vllm(monkeypatch, tmp_path):
    """The engine child builds ``vllm.LLM`` with the job's ``hf_overrides`` (and none when it is empty)."""
    pytest.importorskip("vllm")
    import vllm

    from rlalign_verl.tools.diagnose import runner

    seen: list[dict] = []

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for overrides in ({"head_dtype": "float32"}, {}):
        job = runner.EngineJob("m", [[1, 2]], 4, str(tmp_path / "o.jsonl"), hf_overrides=overrides)
        with pytest.raises(Stop):
            runner._run_job(job)
    assert seen[0]["hf_overrides"] == {"head_dtype": "float32"}
    assert "hf_overrides" not in seen[1]
