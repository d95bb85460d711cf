"""verl's real trainers' fit() on CPU (legacy RayPPOTrainer and v1) log the mismatch metrics every step."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

from callback_steps import logged_fit_steps, read_jsonl  # noqa: E402
from fit_harness import STEPS, fit_config, legacy_trainer, v1_trainer  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures trainer_modules, warnings_log: tests/support/callback_steps.py; transfer_queue: fit_harness.py
pytest_plugins = ["callback_steps", "fit_harness"]
DOCTOR_KEYS = {f"mismatch/doctor/{k}" for k in ("bias", "bias_lo", "bias_hi", "abs_mean", "findings")}


@pytest.mark.parametrize("rollout_is", [None, "token"], ids=["plain", "with-TIS"])
def test_legacy_trainer_fit_logs_mismatch_every_step(
    trainer_modules, tmp_path, monkeypatch, warnings_log, rollout_is
):
    import fit_harness

    # 8 sequences: the fewest the doctor's bias interval needs
    monkeypatch.setattr(fit_harness, "N_PROMPTS", 4)
    overrides = ["trainer.use_v1=false", "actor_rollout_ref.actor.clip_ratio_high=0.28"]
    if rollout_is:  # verl's rollout correction (truncated IS, token level) active at the same time
        overrides.append(f"algorithm.rollout_correction.rollout_is={rollout_is}")
    trainer, rollout = legacy_trainer(fit_config(*overrides, alignment="all"), tmp_path, monkeypatch)
    trainer.fit()

    for logged in logged_fit_steps(tmp_path / "legacy.jsonl", rollout.outputs):
        assert "training/rollout_probs_diff_mean" in logged and "critic/score/mean" in logged
        # the doctor's per-step signature rides along (docs/reading-a-mismatch.md)
        assert DOCTOR_KEYS <= set(logged), sorted(DOCTOR_KEYS - set(logged))
        if rollout_is:
            assert any(k.startswith("rollout_corr/") for k in logged)
    banner = [r.getMessage() for r in warnings_log.records if "alignment regions=" in r.getMessage()]
    # the config skipped the driver's validation and has no rollout.name: the callback says why it has no profile
    assert len(banner) == 1 and banner[0].startswith(
        "alignment regions=rope,swiglu,rmsnorm profile=auto (unresolved: "
    )
    assert banner[0].endswith("; mismatch metrics (mismatch/*) on")


@pytest.mark.parametrize("setting", ["metrics=false", "no alignment section"])
def test_legacy_trainer_fit_without_metrics(trainer_modules, tmp_path, monkeypatch, setting):
    if setting == "metrics=false":
        config = fit_config("trainer.use_v1=false", "alignment.metrics=false")
    else:
        config = fit_config("trainer.use_v1=false", alignment=None)
    trainer, _ = legacy_trainer(config, tmp_path, monkeypatch)
    trainer.fit()
    rows = read_jsonl(tmp_path / "legacy.jsonl")
    assert len(rows) == STEPS
    for row in rows:
        assert not any(k.startswith("mismatch/") for k in row["data"])
        assert "training/rollout_probs_diff_mean" in row["data"]


def test_v1_trainer_fit_logs_mismatch_every_step(trainer_modules, transfer_queue, tmp_path, monkeypatch):
    config = fit_config(
        "trainer.use_v1=true", "data.train_batch_size=3", "actor_rollout_ref.actor.clip_ratio_high=0.28"
    )
    trainer, io = v1_trainer(config, transfer_queue, tmp_path, monkeypatch)
    trainer.fit(agent_loop_manager=None)
    for logged in logged_fit_steps(tmp_path / "v1.jsonl", io.outputs):
        assert {"training/rollout_probs_diff_mean", "actor/entropy", "actor/grad_norm"} <= set(logged)
    assert io.verify_passes == []  # regions=[]: nothing to verify, no extra pass


@pytest.mark.parametrize("twin", [False, True])
def test_v1_trainer_fit_gives_the_doctor_the_group_ids(
    trainer_modules, transfer_queue, tmp_path, monkeypatch, twin
):
    """verl's v1 trainer hands its debug-metrics hook tensors only: the group ids are read from TransferQueue, so
    the duplicate rate is measured there too (two identical samples of one prompt: 2 of 6 sequences)."""
    config = fit_config(
        "trainer.use_v1=true", "data.train_batch_size=3", "actor_rollout_ref.actor.clip_ratio_high=0.28"
    )
    trainer, io = v1_trainer(config, transfer_queue, tmp_path, monkeypatch, twin_first_group=twin)
    trainer.fit(agent_loop_manager=None)
    for logged in logged_fit_steps(tmp_path / "v1.jsonl", io.outputs):
        assert logged["mismatch/doctor/dup_rate"] == (2 / 6 if twin else 0.0)
        assert logged["mismatch/doctor/dup_groups"] == (1 / 3 if twin else 0.0)


@pytest.mark.parametrize("top_p", [0.8, 1.0])
def test_a_systematic_bias_is_named_by_the_doctor(
    trainer_modules, tmp_path, monkeypatch, warnings_log, top_p
):
    """The trainer's log-probs sit log(kept mass) below the rollout's on every token, as with top_p sampling and
    processed log-probs: the doctor logs the bias as not rounding and names top_p when the config has it."""
    import fit_harness

    monkeypatch.setattr(fit_harness, "train_log_probs", lambda roll, step: roll - 0.22)
    monkeypatch.setattr(fit_harness, "N_PROMPTS", 20)  # 40 sequences: enough for a verdict (doctor.MIN_SEQS)
    overrides = ["trainer.use_v1=false", f"actor_rollout_ref.rollout.top_p={top_p}"]
    trainer, rollout = legacy_trainer(fit_config(*overrides, alignment="all"), tmp_path, monkeypatch)
    trainer.fit()
    for logged in logged_fit_steps(tmp_path / "legacy.jsonl", rollout.outputs):
        assert logged["mismatch/doctor/bias"] == pytest.approx(-0.22, abs=1e-6)
        assert logged["mismatch/doctor/findings"] >= 1
    said = [r.getMessage() for r in warnings_log.records if r.getMessage().startswith("doctor: ")]
    assert said and "systematic bias" in said[0]
    assert ("top_p=0.8" in said[0]) == (top_p < 1), said[0]
    assert len(said) == 1  # said once, not every step
