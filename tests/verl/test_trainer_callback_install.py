"""install / uninstall of the callback on verl's real trainer modules, and the hook outside a wrapped fit()."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("verl")

from callback_steps import step_tensors, train_log_probs  # noqa: E402
from verl import DataProto  # noqa: E402

from rlalign_verl.verl import trainer_callback as tc  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures trainer_modules: tests/support/callback_steps.py
pytest_plugins = ["callback_steps"]


def test_install_is_idempotent_and_reversible(trainer_modules):
    v1, legacy = trainer_modules
    debug_mod = importlib.import_module("verl.utils.debug.metrics")
    for module in (legacy, v1):
        tc.uninstall_trainer_callback(module)
    original_debug = debug_mod.calculate_debug_metrics
    original_v1_fit, original_legacy_fit = v1.PPOTrainer.fit, legacy.RayPPOTrainer.fit
    original_v1_global = v1.calculate_debug_metrics
    assert not hasattr(original_debug, "__rlalign_original__")
    assert not tc.is_installed(v1) and not tc.is_installed(legacy)

    for _ in range(2):
        assert tc.install_trainer_callback(legacy) and tc.install_trainer_callback(v1)
    assert tc.is_installed(v1) and tc.is_installed(legacy)
    assert v1.PPOTrainer.fit.__rlalign_original__ is original_v1_fit  # wrapped once, not twice
    assert legacy.RayPPOTrainer.fit.__rlalign_original__ is original_legacy_fit
    assert debug_mod.calculate_debug_metrics.__rlalign_original__ is original_debug
    assert v1.calculate_debug_metrics.__rlalign_original__ is original_v1_global
    # Subclasses (the registered v1 trainers) inherit the wrapped fit.
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls("sync").fit is v1.PPOTrainer.fit

    assert tc.uninstall_trainer_callback(v1) and tc.uninstall_trainer_callback(legacy)
    assert v1.PPOTrainer.fit is original_v1_fit and legacy.RayPPOTrainer.fit is original_legacy_fit
    assert debug_mod.calculate_debug_metrics is original_debug
    assert v1.calculate_debug_metrics is original_v1_global
    assert not tc.uninstall_trainer_callback(v1)


def test_hook_is_inert_outside_a_wrapped_fit(trainer_modules):
    """Other callers of calculate_debug_metrics (no wrapped fit running) get verl's result unchanged."""
    data = step_tensors(5)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 5)
    batch = DataProto.from_dict(data)
    debug_mod = importlib.import_module("verl.utils.debug.metrics")
    out = debug_mod.calculate_debug_metrics(batch)
    assert not any(k.startswith("mismatch/") for k in out)
    assert "training/rollout_probs_diff_mean" in out
