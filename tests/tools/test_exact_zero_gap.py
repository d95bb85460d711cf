"""Issue 12's done criteria on the real vLLM CPU engine: the aligned gap is exactly zero.

One engine child (three jobs) samples 8 prompts x 16 tokens from a tiny Qwen3 of a shape no other test
uses, with every GEMM's K < 512 (oneDNN's AMX bf16 GEMM with K >= 512 rounds differently per row count,
which no trainer region can mirror). HF recomputes the log-probs with diagnose's recompute helpers.
- eager engine, bf16 head: rope+swiglu+rmsnorm+attention -> every sampled token's Δlogp is exactly 0;
  the three regions alone are not (so the test can fail).
- compiled engine: + attention + compiled_norm -> every sampled token's Δlogp is exactly 0; without
  compiled_norm it is not.
- eager engine, fp32 head (hf_overrides head_dtype=float32): + lm_head -> the prompt log-probs are
  bit-identical. The engine computes them per request over prompt_len - 1 >= 16 rows; the fp32 head GEMM
  gives the same bits for >= 16 rows (scripts/fp32_head_rows.py), not for the <= 8 rows of a decode step,
  so sampled tokens are not asserted there. Without lm_head the prompt log-probs differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from recompute_threads import single_thread

from rlalign_verl.align.patch import apply_alignment, remove_alignment
from rlalign_verl.tools.diagnose.pipeline import load_hf, recompute
from rlalign_verl.tools.diagnose.rollouts import read_rollouts
from rlalign_verl.tools.diagnose.runner import EngineJob, engine_distribution, run_engine_jobs
from rlalign_verl.tools.diagnose.tiny import TinySpec, _write_checkpoint, tiny_prompts

pytestmark = pytest.mark.engine

# Held-out shape: hidden 160, attention width 4 x 64 = 256, MLP 320; every GEMM has K < 512. Six layers:
# with three, the compiled engine matched + attention without compiled_norm too (0 of 128 tokens differed).
SPEC = TinySpec("qwen3", 160, 320, 6, 4, 2, 64, rope_theta=1_000_000.0)
THREE = ("rope", "swiglu", "rmsnorm")
FOUR = (*THREE, "attention")
MIN_PROMPT = 17  # prompt_len - 1 >= 16 head rows per request: the fp32 head GEMM's row-count-stable range
JOBS = {"eager": (True, {}), "compiled": (False, {}), "eager-fp32": (True, {"head_dtype": "float32"})}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint, the HF model and the three engine dumps (one engine child)."""
    if engine_distribution() is None:
        pytest.skip("vLLM is not installed (pip install 'rlalign-verl[engine]' for the CPU build)")
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("exact_zero")
    model_dir = root / "qwen3-h160"
    model_dir.mkdir()
    _write_checkpoint(model_dir, SPEC, 11)
    ids = tiny_prompts(AutoTokenizer.from_pretrained(model_dir), 16, seed=5)
    prompts = [ids[i] + ids[15 - i] for i in range(8)]
    assert min(map(len, prompts)) >= MIN_PROMPT, [len(p) for p in prompts]
    jobs = [
        EngineJob(str(model_dir), prompts, 16, str(root / f"{k}.jsonl"), enforce_eager=e, hf_overrides=o)
        for k, (e, o) in JOBS.items()
    ]
    paths = run_engine_jobs(jobs, log_path=root / "engine.log")
    read = {k: read_rollouts(p) for k, p in zip(JOBS, paths, strict=True)}
    modes = {k: (h.profile, h.extra["hf_overrides"]) for k, (h, _) in read.items()}
    assert modes == {
        "eager": ("vllm-cpu-eager", {}),
        "compiled": ("vllm-cpu", {}),
        "eager-fp32": ("vllm-cpu-eager", {"head_dtype": "float32"}),
    }, modes
    dumps = {k: ro for k, (_, ro) in read.items()}
    return {"hf": load_hf(Path(model_dir)), "dumps": dumps}


def _lps(hf, rollouts: list, engine: str, regions: tuple, **kw) -> list[torch.Tensor]:
    """HF's fp32 log-probs of every token after the first (prompt and response) under ``regions``."""
    apply_alignment(hf, regions=regions, engine=engine, **kw)
    try:
        full = [
            type(r)(r.prompt_ids[:1], r.prompt_ids[1:] + r.response_ids, [], None) for r in rollouts
        ]  # everything after token 0 as "response": one recompute gives prompt and response log-probs
        with single_thread():
            return recompute(lambda x: hf(input_ids=x[None]).logits[0], full, "exact-zero")
    finally:
        remove_alignment(hf)


def _deltas(lps: list[torch.Tensor], rollouts: list, part: str) -> torch.Tensor:
    """Trainer minus engine log-probs of the sampled tokens (``part="response"``) or the prompt tokens."""
    out = []
    for lp, r in zip(lps, rollouts, strict=True):
        p = len(r.prompt_ids) - 1
        if part == "response":
            out.append(lp[p:] - torch.tensor(r.response_logprobs))
        else:
            out.append(lp[:p] - torch.tensor(r.prompt_logprobs[1:]))
    return torch.cat(out)


def test_eager_engine_four_regions_exactly_zero(run) -> None:
    """Eager engine: + attention makes every sampled token exact; the three regions alone do not."""
    hf, ro = run["hf"], run["dumps"]["eager"]
    four = _deltas(_lps(hf, ro, "vllm-cpu-eager", FOUR), ro, "response")
    three = _deltas(_lps(hf, ro, "vllm-cpu-eager", THREE), ro, "response")
    assert four.numel() == 8 * 16
    assert int((four != 0).sum()) == 0, f"{int((four != 0).sum())} tokens differ, max {four.abs().max()}"
    assert int((three != 0).sum()) > 0, "the three regions alone are already exact: the test cannot fail"


def test_compiled_engine_compiled_norm_exactly_zero(run) -> None:
    """Compiled engine: + attention + compiled_norm makes every sampled token exact; without it, not."""
    hf, ro = run["hf"], run["dumps"]["compiled"]
    d = _deltas(_lps(hf, ro, "vllm-cpu", FOUR, compiled_norm=True), ro, "response")
    eager_norm = _deltas(_lps(hf, ro, "vllm-cpu", FOUR), ro, "response")
    assert d.numel() == 8 * 16
    assert int((d != 0).sum()) == 0, f"{int((d != 0).sum())} tokens differ, max {d.abs().max()}"
    assert int((eager_norm != 0).sum()) > 0, "exact without compiled_norm: the test cannot fail"


def test_fp32_head_lm_head_prompt_logprobs_bit_identical(run) -> None:
    """Engine fp32 head: with lm_head the prompt log-probs (>= 16 head rows) are bit-identical; without, not."""
    hf, ro = run["hf"], run["dumps"]["eager-fp32"]
    with_head = _deltas(
        _lps(hf, ro, "vllm-cpu-eager", (*FOUR, "lm_head"), head_dtype="float32"), ro, "prompt"
    )
    without = _deltas(_lps(hf, ro, "vllm-cpu-eager", FOUR, head_dtype="float32"), ro, "prompt")
    assert with_head.numel() == sum(len(r.prompt_ids) - 1 for r in ro)
    assert int((with_head != 0).sum()) == 0, (
        f"{int((with_head != 0).sum())} differ, max {with_head.abs().max()}"
    )
    assert int((without != 0).sum()) > 0, "exact without lm_head: the engine head is not fp32"
