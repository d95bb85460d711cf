"""The callback's refusals: broken or all-NaN batches warn and log nothing (or only counts), a config
without rollout log-probs is refused, a module that is not a verl trainer is left alone."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("verl")

from callback_steps import step_tensors, train_log_probs, verl_config  # noqa: E402
from verl import DataProto  # noqa: E402

from rlalign_verl.base.errors import AlignmentError  # noqa: E402
from rlalign_verl.verl import trainer_callback as tc  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures base_config, warnings_log: tests/support/callback_steps.py
pytest_plugins = ["callback_steps"]


def _broken_batches():
    good = step_tensors(3)
    good["old_log_probs"] = train_log_probs(good["rollout_log_probs"], 3)
    no_rollout = {k: v for k, v in good.items() if k != "rollout_log_probs"}
    wider = dict(good, rollout_log_probs=torch.zeros(6, 9))
    no_mask = {k: v for k, v in good.items() if k not in ("response_mask", "attention_mask")}
    return {
        "missing rollout_log_probs": (DataProto.from_dict(no_rollout), "rollout_log_probs"),
        "shape mismatch": (DataProto.from_dict(wider), "shape"),
        "no mask": (DataProto.from_dict(no_mask), "response_mask"),
        "not a DataProto": (None, "DataProto"),
    }


@pytest.mark.parametrize(
    "case", ["missing rollout_log_probs", "shape mismatch", "no mask", "not a DataProto"]
)
def test_broken_input_warns_once_and_returns_nothing(base_config, warnings_log, case, monkeypatch):
    from rlalign_verl.base import log

    monkeypatch.setattr(log, "_warned", set())
    batch, words = _broken_batches()[case]
    for _ in range(3):  # every step has the problem: the steps go on, the warning is said once
        assert tc.step_mismatch_metrics(batch, base_config) == {}
    messages = [r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "mismatch metrics skipped" in messages[0] and words in messages[0]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("response_mask", 0.5, "other than 0 and 1"), ("old_log_probs", 0.7, "values up to 0.7")],
)
def test_impossible_values_skip_the_metrics_not_the_step(
    base_config, warnings_log, monkeypatch, field, value, words
):
    """A refused input (a soft mask, probabilities for log-probs) never reaches the dashboard as numbers."""
    from rlalign_verl.base import log

    monkeypatch.setattr(log, "_warned", set())
    data = step_tensors(3)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 3)
    data[field] = torch.full_like(data[field], value, dtype=torch.float32)
    assert tc.step_mismatch_metrics(DataProto.from_dict(data), base_config) == {}
    messages = [r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and words in messages[0], messages


def test_all_nan_step_warns_and_logs_only_counts(base_config, warnings_log):
    data = step_tensors(4)
    data["old_log_probs"] = torch.full_like(data["rollout_log_probs"], float("nan"))
    out = tc.step_mismatch_metrics(DataProto.from_dict(data), base_config)
    n = int(data["response_mask"].sum())
    assert out == {"mismatch/num_tokens": 0, "mismatch/num_seqs": 0, "mismatch/nonfinite_tokens": n}
    assert any("NaN/inf" in r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING)


def test_check_metrics_config():
    from rlalign_verl.verl.config import check_metrics_config, read_spec

    def check(config):
        check_metrics_config(config, read_spec(config))

    with pytest.raises(AlignmentError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=True"):
        check(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false"))
    check(verl_config())  # verl's default: calculate_log_probs=True
    check(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false", "alignment.metrics=false"))
    check(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false", alignment=None))
    with pytest.raises(AlignmentError, match="alignment.verify.enable=true"):  # verification needs them too
        check(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false", "alignment.metrics=false",
                          "alignment.regions=[rope]"))  # fmt: skip
    assert tc.metrics_enabled(verl_config(alignment="all"))
    assert not tc.metrics_enabled(verl_config(alignment=None))


def test_install_refuses_unknown_module(warnings_log):
    assert not tc.install_trainer_callback(json)
    assert "not a verl trainer module" in warnings_log.text
