"""The engine-compiled norms on an MoE model, on the real vLLM CPU engine (compiled path, rollout TP 1).

The conftest's engine child samples the tiny Qwen3-MoE and a tiny Qwen2-MoE whose shared expert keeps K < 512
(``qwen2_moe_k384``: CPU exactness holds for K < 512, docs/results-cpu.md) (32 prompts x 32 tokens) compiled. HF
recomputes the log-probs with rope, swiglu, rmsnorm, attention and moe, the experts run by the engine's own op: with
the norms compiled as the engine compiles them (``experimental.compiled_norm``) every sampled token's Δlogp is exactly
0 — the claim is bit-exact, so the test is; without them some tokens are not (measured on an AMX host: Qwen3-MoE
738/1024 exact). A Qwen3-MoE layer's output reaches the next norm as one buffer (the expert op's output), so the
engine stores the residual sum at the same norms as in a dense model; Qwen2-MoE's gated shared-expert sum is formed
inside the norm kernel from three buffers, which moves the stored sums (``inductor_norm.mlp_output_reads``).
"""

from __future__ import annotations

import pytest
from recompute_threads import engine_gaps

from rlalign_verl.tools.diagnose.pipeline import load_hf

pytestmark = pytest.mark.engine

REGIONS = ("rope", "swiglu", "rmsnorm", "attention", "moe")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe_k384"])
def test_moe_compiled_reaches_the_exact_zero_with_the_compiled_norms(engine_rollouts, monkeypatch, arch):
    from rlalign_verl.align.engine_ops.moe_op import engine_op_available

    ok, why = engine_op_available()
    if not ok:
        pytest.skip(f"vLLM's cpu_fused_moe is not callable here ({why})")
    run = engine_rollouts(arch, "compiled")
    assert run.header.mode == "compiled" and run.header.profile == "vllm-cpu"
    hf = load_hf(run.model_dir)
    got = engine_gaps(hf, run, REGIONS, moe_variant="engine-op", compiled_norm=True)
    without = engine_gaps(hf, run, REGIONS, moe_variant="engine-op")
    print(f"\n{arch} compiled TP=1: {int((got == 0).sum())}/{got.numel()} exact with the compiled norms, "
          f"{int((without == 0).sum())} without (mean {float(without.mean()):.4g})")  # fmt: skip
    assert int((got != 0).sum()) == 0, f"{int((got == 0).sum())}/{got.numel()} tokens exact"
    assert int((without == 0).sum()) < without.numel(), "the compiled norms would change nothing here"
    if arch == "qwen2_moe_k384":
        # the stored-sum norms of a layer whose shared-expert sum the engine forms inside the norm kernel: counted
        # as one read like a dense MLP's output instead of three, the norms store at other positions
        import rlalign_verl.align.regions.inductor_norm as inductor_norm

        monkeypatch.setattr(inductor_norm, "mlp_output_reads", lambda family, tp: 1)
        one_read = engine_gaps(hf, run, REGIONS, moe_variant="engine-op", compiled_norm=True)
        print(f"{arch}: {int((one_read == 0).sum())} exact with the MLP output counted as one read")
        assert int((one_read == 0).sum()) < one_read.numel()
