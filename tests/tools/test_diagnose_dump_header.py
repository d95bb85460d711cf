"""Every field of a rollout dump's header is used or refused in one line (``file:1``), never ignored.

Issue 34 item 5: a profile that contradicts its mode, ``logprobs_mode`` / temperature / top-p that change
what the log-probs are, ``tensor_parallel_size``, unknown fields. No engine runs here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_dumps import SAMPLE, header, write_dump

from rlalign_verl.tools.cli import main as cli_main
from rlalign_verl.tools.diagnose.rollouts import RolloutFormatError, read_rollouts

MEAN = "mismatch/logp_abs_diff_mean"
RAW_FIX = ["logprobs_mode='raw_logprobs'", "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"]
_header, _write = header, write_dump


def _refused(tmp_path: Path, words: list[str], **changes) -> str:
    with pytest.raises(RolloutFormatError) as e:
        read_rollouts(_write(tmp_path / "d.jsonl", **changes))
    msg = str(e.value)
    assert "\n" not in msg and "d.jsonl:" in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def _accepted(tmp_path: Path, **changes):
    return read_rollouts(_write(tmp_path / "ok.jsonl", **changes))[0]


def test_profile_must_match_mode(tmp_path):
    _refused(
        tmp_path,
        [
            "profile 'vllm-cpu-eager' contradicts its mode 'compiled'",
            "profile 'vllm-cpu' for mode 'compiled'",
        ],
        profile="vllm-cpu-eager",
    )
    _refused(tmp_path, ["'vllm-cpu' contradicts its mode 'eager'", "profile 'vllm-cpu-eager'"], mode="eager")
    _refused(tmp_path, ["'vllm-eager' contradicts its mode 'compiled'"], engine="vllm", profile="vllm-eager")
    _refused(tmp_path, ["'vllm' contradicts its mode 'eager'"], engine="vllm", profile="vllm", mode="eager")
    _refused(tmp_path, ["mode 'cuda_graph'", "'compiled' nor 'eager'"], mode="cuda_graph")
    _refused(tmp_path, ["compilation.mode 'NONE'"], compilation={"mode": "NONE"})
    for mode in ("compiled", "eager"):  # SGLang's kernels round the same with or without CUDA graphs
        assert _accepted(tmp_path, engine="sglang", profile="sglang", mode=mode).mode == mode
    assert _accepted(tmp_path, mode="eager", profile="vllm-cpu-eager").profile == "vllm-cpu-eager"


def test_profile_mode_contradiction_is_one_cli_line_before_anything_runs(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("qwen2")
    dump = _write(tmp_path / "d.jsonl", model=str(model), profile="vllm-cpu-eager")
    argv = ["diagnose", "--rollout-logprobs", str(dump), "--out", str(tmp_path / "out"), "--no-plots"]
    assert cli_main([*argv, "--no-floor", "--no-probe", "--no-ladder", "--settings", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rlalign-verl] ERROR ") and err.count("\n") == 1, err
    assert "'vllm-cpu-eager'" in err and "'compiled'" in err and "fix the header" in err


def test_tensor_parallel_size(tmp_path):
    # TP > 1 is used (the tp setting, the ladder's + tp rung and the floor mirror it), not refused
    assert _accepted(tmp_path, tensor_parallel_size=2).tensor_parallel_size == 2
    for bad in (0, -4):
        _refused(
            tmp_path, ["tensor_parallel_size must be an integer >= 1", repr(bad)], tensor_parallel_size=bad
        )
    for bad in (1.5, "2", True, None):
        _refused(tmp_path, ["'tensor_parallel_size' must be an integer"], tensor_parallel_size=bad)
    assert _accepted(tmp_path, tensor_parallel_size=1).tensor_parallel_size == 1


def test_unknown_fields_and_types(tmp_path):
    _refused(tmp_path, ["unknown header field(s) ['temprature']", "under 'extra'"], temprature=0.7)
    _refused(tmp_path, ["dtype 'float16'", "dtype=bfloat16"], dtype="float16")
    assert _accepted(tmp_path, dtype="bf16").dtype == "bf16"
    _refused(tmp_path, ["engine 'sglang' contradicts profile 'vllm-cpu'"], engine="sglang")
    _refused(tmp_path, ["device 'cuda:0' contradicts profile 'vllm-cpu'"], device="cuda:0")
    _refused(tmp_path, ["engine 'vllm-cpu' (the CPU build) contradicts profile 'vllm'"], profile="vllm")
    assert _accepted(tmp_path, engine="vllm", profile="vllm", device="cpu").profile == "vllm"  # the default
    _refused(tmp_path, ["extra.hf_overrides must be an object"], extra={"hf_overrides": ["head_dtype"]})
    _refused(tmp_path, ["extra.model_identity must be an object"], extra={"model_identity": "qwen2"})
    _refused(
        tmp_path,
        ["hf_overrides changes ['num_hidden_layers']", "only head_dtype"],
        extra={"hf_overrides": {"head_dtype": "float32", "num_hidden_layers": 2}},
    )
    _refused(tmp_path, ["sampling.temperature must be a finite number >= 0"], sampling={"temperature": "hot"})
    _refused(tmp_path, ["sampling.top_p must be a number in (0, 1]"], sampling={"top_p": 0})
    _refused(tmp_path, ["sampling.top_k must be an integer"], sampling={"top_k": 1.5})
    _refused(tmp_path, ["sampling.max_tokens must be an integer >= 1"], sampling={"max_tokens": 0})


def test_responses_within_max_tokens(tmp_path):
    with pytest.raises(
        RolloutFormatError, match=r"d\.jsonl:3: response of 3 tokens, more than .*max_tokens 2"
    ):
        read_rollouts(_write(tmp_path / "d.jsonl", [{**SAMPLE, "response_ids": [5, 6], "response_logprobs": [-1.0, -1.0]}, SAMPLE], sampling={"max_tokens": 2}))  # fmt: skip


def test_logprobs_mode_and_sampling(tmp_path):
    from rlalign_verl.tools.diagnose.dump_header import logprob_temperature

    processed = {"logprobs_mode": "processed_logprobs"}
    for mode in ("raw_logits", "processed_logits"):
        _refused(tmp_path, ["logits, not log-probs", *RAW_FIX], logprobs_mode=mode)
    _refused(tmp_path, ["not a vLLM logprobs_mode"], logprobs_mode="final")
    for shaping in ({"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.05}, {"repetition_penalty": 1.1},
                    {"presence_penalty": 0.5}, {"min_tokens": 4}, {"logit_bias": {"5": 2.0}}):  # fmt: skip
        key = next(iter(shaping))
        _refused(
            tmp_path,
            [f"{key} ", "renormalised", *RAW_FIX],
            sampling={"temperature": 1.0, **shaping},
            **processed,
        )
    _refused(tmp_path, ["['typical_p']", "does not know", *RAW_FIX], sampling={"typical_p": 0.9}, **processed)
    # no logprobs_mode written: raw is assumed only where raw and processed agree
    _refused(
        tmp_path, ["temperature 0.7", "no logprobs_mode"], sampling={"temperature": 0.7}, logprobs_mode=...
    )
    _refused(tmp_path, ["top_p 0.9", "no logprobs_mode"], sampling={"top_p": 0.9}, logprobs_mode=...)
    _refused(tmp_path, ["repetition_penalty 1.2", "no logprobs_mode"], sampling={"repetition_penalty": 1.2})
    assert logprob_temperature(_accepted(tmp_path, sampling={"temperature": 1}, logprobs_mode=...)) == 1.0
    # raw log-probs are of the unmodified distribution: sampling settings only chose the tokens
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "typical_p": 0.5}
    raw = _accepted(tmp_path, sampling=sampling, logprobs_mode="raw_logprobs")
    assert logprob_temperature(raw) == 1.0
    # processed log-probs carry the temperature (greedy: none), which the recompute applies
    sampling = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 3, "ignore_eos": True}
    assert logprob_temperature(_accepted(tmp_path, sampling=sampling, **processed)) == 0.7
    for greedy in (0, 0.0, 1e-6):
        assert logprob_temperature(_accepted(tmp_path, sampling={"temperature": greedy}, **processed)) == 1.0


def _hf_logprobs(model_dir: Path, sample: dict, temperature: float) -> list[float]:
    """The unaligned HF model's log-probs of the sample's response at ``temperature`` (fp32 division)."""
    import torch

    from rlalign_verl.tools.diagnose.pipeline import load_hf

    hf, before = load_hf(model_dir), torch.get_num_threads()
    torch.set_num_threads(1)  # what diagnose uses for a model this small: same GEMM splits, same bits
    try:
        ids = torch.tensor(sample["prompt_ids"] + sample["response_ids"])
        with torch.no_grad():
            logits = hf(input_ids=ids[None]).logits[0].float() / temperature
        n = len(sample["prompt_ids"])
        return logits.log_softmax(-1)[n - 1 : -1].gather(-1, ids[n:, None])[:, 0].tolist()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_processed_logprobs_temperature_is_applied_to_the_recompute(tiny_checkpoint, tmp_path):
    """A dump of processed log-probs at temperature 0.7 equal to HF's own: the `none` gap is exactly 0 (the
    recompute divides by 0.7 as vLLM did); the same numbers labelled raw are compared at temperature 1."""
    from rlalign_verl.tools.diagnose.command import diagnose
    from rlalign_verl.tools.diagnose.options import DiagnoseOptions

    model = tiny_checkpoint("qwen2")
    sample = {**SAMPLE, "response_logprobs": _hf_logprobs(model, SAMPLE, 0.7)}
    gaps, modes = {}, {}
    for mode in ("processed_logprobs", "raw_logprobs"):
        dump = _write(tmp_path / f"{mode}.jsonl", [sample], model=str(model), logprobs_mode=mode,
                      sampling={"temperature": 0.7, "top_p": 1.0, "top_k": -1})  # fmt: skip
        opts = DiagnoseOptions(
            rollout_logprobs=str(dump), settings="none", out=str(tmp_path / mode),
            floor=False, probe=False, plots=False, ladder=False,
        )  # fmt: skip
        result = diagnose(opts)
        gaps[mode], modes[mode] = result["settings"]["none"][MEAN], result["engine"].get("logprobs_mode")
    assert gaps["processed_logprobs"] == 0.0, gaps
    assert gaps["raw_logprobs"] > 0.01, gaps
    assert modes == {m: m for m in modes}, modes  # recorded in diagnose.json
