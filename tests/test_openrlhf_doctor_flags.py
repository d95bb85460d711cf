"""OpenRLHF's start-up confounder checks (rlalign_verl/openrlhf/doctor_flags.py) on argv alone.

Facts of OpenRLHF 0.11.2 written here, not read from the module: vLLM returns processed log-probs whenever
rollout log-probs are collected; ``--rollout.micro_batch_size`` and ``--train.micro_batch_size`` default to 1; with
``--train.dynamic_batch_enable`` the token budgets count instead, ``--train.max_tokens_per_gpu`` defaults to 16192
and ``--rollout.max_tokens_per_gpu`` to the update's.
"""

from __future__ import annotations

import pytest

from rlalign_verl.openrlhf.doctor_flags import check, confounders
from rlalign_verl.request.findings import DoctorConfigError

IS_ON = ["--algo.advantage.is_correction_level", "token"]


def _keys(argv, collect=False, allow=()):
    return [(f.key, f.severity) for f in confounders(argv, collect_rollout_logprobs=collect, allow=allow)]


@pytest.mark.parametrize(
    ("argv", "collect", "want"),
    [
        ([], False, []),
        (["--rollout.top_p", "0.8"], False, []),  # no rollout log-probs: nothing compares them
        (["--rollout.top_p", "0.8"], True, [("top_p_top_k", "warn")]),  # measure-only: the loss is unchanged
        (["--rollout.top_p=0.8", *IS_ON], False, [("top_p_top_k", "error")]),  # fed into the loss
        (["--rollout.top_p", "1.0", *IS_ON], False, []),
        (["--rollout.top_p", "0.8", "--algo.advantage.is_correction_level", "off"], False, []),
        (["--rollout.micro_batch_size", "4"], False, [("micro_batch", "warn")]),  # the other is 1 by default
        (["--train.micro_batch_size", "2"], False, [("micro_batch", "warn")]),
        (["--rollout.micro_batch_size", "4", "--train.micro_batch_size", "4"], False, []),
        (["--micro_rollout_batch_size", "8"], False, []),  # old release, other defaults: both must be given
        (
            ["--micro_rollout_batch_size", "8", "--micro_train_batch_size", "4"],
            False,
            [("micro_batch", "warn")],
        ),
        (
            ["--rollout.micro_batch_size=abc", "--train.micro_batch_size", "4"],
            False,
            [],
        ),  # OpenRLHF refuses it
        (
            ["--train.dynamic_batch_enable", "--rollout.micro_batch_size", "4"],
            False,
            [],
        ),  # token budgets instead
        (
            ["--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", "4096"],
            False,
            [("micro_batch", "warn")],
        ),
        (
            ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"],
            False,
            [],
        ),  # rollout's follows
        (["--rollout.top_p"], True, []),  # malformed: OpenRLHF's parser names it
        (["--train.async_enable"], False, [("async_staleness", "warn")]),
        (["--train.agent_func_path", "agent.py"], False, [("multi_turn", "warn")]),
    ],
)
def test_each_confounder_and_its_severity(argv, collect, want):
    assert _keys(argv, collect) == want


def test_lines_name_the_flag_the_effect_and_the_fix():
    (line,) = check(
        ["--train.async_enable", "--train.partial_rollout_enable"], collect_rollout_logprobs=False
    )
    assert line.startswith("--train.async_enable:") and "partial rollouts mix old and new weights" in line
    (line,) = check(["--rollout.micro_batch_size", "4"], collect_rollout_logprobs=False)
    assert "--rollout.micro_batch_size=4 but --train.micro_batch_size=1" in line and "fix: give both" in line
    (line,) = check(
        ["--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu=4096"], collect_rollout_logprobs=False
    )
    assert "--rollout.max_tokens_per_gpu=4096 but --train.max_tokens_per_gpu=16192" in line
    with pytest.raises(DoctorConfigError) as err:
        check(["--rollout.top_p", "0.9", *IS_ON], collect_rollout_logprobs=False)
    msg = str(err.value)
    assert "\n" not in msg and "--rollout.top_p=0.9" in msg and "log(kept mass)" in msg
    assert "fix: --rollout.top_p=1" in msg and msg.endswith("--alignment.doctor.allow top_p_top_k")


def test_acknowledged_errors_become_warnings_and_unknown_keys_are_refused():
    argv = ["--rollout.top_p", "0.9", *IS_ON]
    (line,) = check(argv, collect_rollout_logprobs=False, allow=["top_p_top_k"])
    assert line.endswith("(acknowledged in --alignment.doctor.allow)")
    with pytest.raises(DoctorConfigError, match="not finding keys"):
        check(argv, collect_rollout_logprobs=False, allow=["top_p"])
