"""Multi-turn rounds and token identity through verl's step: a real DataProto in agent-loop layout, Tracking."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from callback_steps import read_jsonl, step_tensors, train_log_probs  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.utils.tracking import Tracking  # noqa: E402

from rlalign_verl.measure.doctor import Doctor  # noqa: E402
from rlalign_verl.verl.doctor_step import doctor_step  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures warnings_log: tests/support/callback_steps.py
pytest_plugins = ["callback_steps"]


def _agent_loop_step(seed: int) -> dict[str, torch.Tensor]:
    """A step batch as verl's agent loop lays it out: 1 on generated tokens, 0 on the tool's (two rounds)."""
    data = step_tensors(seed, n=12, resp_len=40)
    mask = torch.zeros_like(data["response_mask"])
    mask[:, :15], mask[:, 20:34] = 1, 1  # round 1, a 5-token tool response, round 2, padding
    data["response_mask"] = mask
    data["rollout_log_probs"] = -(
        0.4 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 3
    )
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], seed).clamp(max=0.0)
    return data


def test_rounds_and_identity_reach_tracking_and_a_shift_is_named(tmp_path, monkeypatch, warnings_log):
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    doctor = Doctor({"multi_turn": True})
    clean = _agent_loop_step(1)
    tracking.log(data=doctor_step(doctor, DataProto.from_dict(clean), 1), step=1)
    shifted = _agent_loop_step(2)
    prompt_len = shifted["prompts"].shape[1]
    shifted["input_ids"][:, prompt_len + 1 :] = shifted["input_ids"][:, prompt_len:-1].clone()  # one late
    tracking.log(data=doctor_step(doctor, DataProto.from_dict(shifted), 2), step=2)
    tracking.finish()

    first, second = (row["data"] for row in read_jsonl(path))
    assert first["mismatch/rounds/per_seq_mean"] == 2.0
    assert first["mismatch/round_1/num_tokens"] == 12 * 15 and first["mismatch/round_2/num_tokens"] == 12 * 14
    assert first["mismatch/doctor/token_id_mismatch"] == 0.0 and first["mismatch/doctor/findings"] == 0.0
    ids, moved = shifted["responses"], shifted["input_ids"][:, prompt_len:]
    want = float(((ids != moved) & (shifted["response_mask"] != 0)).sum()) / float(
        shifted["response_mask"].sum()
    )
    assert second["mismatch/doctor/token_id_mismatch"] == pytest.approx(want, rel=1e-12) and want > 0.5
    assert second["mismatch/doctor/findings"] == 1.0
    lines = [r.getMessage() for r in warnings_log.records if "doctor:" in r.getMessage()]
    assert (
        len(lines) == 1 and "step 2:" in lines[0] and "other token ids than the rollout sampled" in lines[0]
    )


def test_single_turn_batches_get_identity_but_no_round_keys():
    data = step_tensors(3)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 3)
    sig = doctor_step(Doctor(), DataProto.from_dict(data), 1)
    assert sig["mismatch/doctor/token_id_mismatch"] == 0.0
    assert not any(k.startswith(("mismatch/round_", "mismatch/rounds/")) for k in sig)
