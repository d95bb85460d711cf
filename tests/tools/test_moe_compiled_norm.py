"""The engine-compiled norms on an MoE model, on the real vLLM CPU engine (compiled path, rollout TP 1).

The conftest's engine child samples the tiny Qwen3-MoE (32 prompts x 32 tokens) compiled. HF recomputes the log-probs
with rope, swiglu, rmsnorm, attention and moe, the experts run by the engine's own op: with the norms compiled as the
engine compiles them (``experimental.compiled_norm``) every sampled token's Δlogp is exactly 0 — the claim is
bit-exact, so the test is; without them some tokens are not (measured 738/1024 exact on an AMX host). The MoE layer's
output reaches the next norm as one buffer (the expert op's output), so the engine stores the residual sum at the
same norms as in a dense model.
"""

from __future__ import annotations

import pytest
from recompute_threads import engine_gaps

from rlalign_verl.tools.diagnose.pipeline import load_hf

pytestmark = pytest.mark.engine

REGIONS = ("rope", "swiglu", "rmsnorm", "attention", "moe")


def test_qwen3_moe_compiled_reaches_the_exact_zero_with_the_compiled_norms(engine_rollouts):
    from rlalign_verl.align.engine_ops.moe_op import engine_op_available

    ok, why = engine_op_available()
    if not ok:
        pytest.skip(f"vLLM's cpu_fused_moe is not callable here ({why})")
    run = engine_rollouts("qwen3_moe", "compiled")
    assert run.header.mode == "compiled" and run.header.profile == "vllm-cpu"
    hf = load_hf(run.model_dir)
    got = engine_gaps(hf, run, REGIONS, moe_variant="engine-op", compiled_norm=True)
    without = engine_gaps(hf, run, REGIONS, moe_variant="engine-op")
    print(f"\nqwen3_moe compiled TP=1: {int((got == 0).sum())}/{got.numel()} exact with the compiled norms, "
          f"{int((without == 0).sum())} without (mean {float(without.mean()):.4g})")  # fmt: skip
    assert int((got != 0).sum()) == 0, f"{int((got == 0).sum())}/{got.numel()} tokens exact"
    assert int((without == 0).sum()) < without.numel(), "the compiled norms would change nothing here"
