"""Where verl's trainers are hooked for in-run verification (:mod:`.verify_run` does the work).

- v1 trainer: ``PPOTrainer._compute_old_log_prob`` (both modes: after verl's recompute, or in bypass mode where
  verl copies the rollout's log-probs) — the metrics go into the step's ``metrics`` dict; the same wrapper reads
  the step's group ids for the doctor before verl's recompute (:func:`.doctor_step.v1_group_ids`);
- legacy trainer: the ``calculate_debug_metrics`` hook (:mod:`.trainer_callback`, decoupled mode) and
  ``rollout_corr_helper.apply_bypass_mode`` (bypass mode, metrics kept until the step's
  ``compute_data_metrics``).

Installed with the trainer callback (:data:`VERIFY_PATCHES`); every hook does nothing outside a verify step.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from rlalign_verl.verl.run_context import Run, active


def _due(run: Run | None, trainer: Any) -> bool:
    return (
        run is not None
        and run.verify is not None
        and run.verify.due(int(getattr(trainer, "global_steps", 0)))
    )


def legacy_verify_step(run: Run, batch: Any, *, bypass: bool) -> dict[str, float]:
    """The legacy trainer's verification of this step's batch (``{}`` when the step is not due)."""
    if not _due(run, run.trainer):
        return {}
    from rlalign_verl.verl.verify_run import guarded, legacy_verify

    return guarded(run.verify, legacy_verify, run.verify, run.trainer, batch, bypass=bypass)


def _bypass_mode(config: Any) -> bool:
    corr = config.algorithm.get("rollout_correction", None) if config is not None else None
    return bool(corr and corr.get("bypass_mode", False))


def wrap_v1_old_log_prob(original: Callable[..., Any]) -> Callable[..., Any]:
    """Verification after verl's recompute; before it, the step's group ids for the doctor (the debug-metrics hook
    that verl calls inside this method gets no ``uid``)."""

    @functools.wraps(original)
    def _compute_old_log_prob(self: Any, batch: Any, metrics: dict) -> Any:
        run = active()
        if run is not None and not run.legacy and run.doctor is not None and not _bypass_mode(self.config):
            from rlalign_verl.verl.doctor_step import (
                v1_group_ids,  # bypass mode calls no debug-metrics hook: nothing to feed
            )

            run.group_ids = v1_group_ids(batch)
        try:
            out = original(self, batch, metrics)
        finally:
            if run is not None:
                run.group_ids = None
        if run is not None and not run.legacy and _due(run, self):
            from rlalign_verl.verl.verify_run import guarded, v1_verify

            metrics.update(
                guarded(run.verify, v1_verify, run.verify, self, batch, bypass=_bypass_mode(self.config))
            )
        return out

    return _compute_old_log_prob


def wrap_bypass(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_bypass_mode(batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(batch, *args, **kwargs)
        run = active()
        if run is not None and run.legacy:
            step = int(getattr(run.trainer, "global_steps", 0))
            found = legacy_verify_step(run, batch, bypass=True)
            if found:
                run.verify.pending[step] = found
        return out

    return apply_bypass_mode


def wrap_data_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_data_metrics(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        run = active()
        if run is not None and run.legacy and run.verify is not None and run.verify.pending:
            found = run.verify.pending.pop(int(getattr(run.trainer, "global_steps", 0)), None)
            if found:
                result = {**result, **found}
        return result

    return compute_data_metrics


def _rollout_corr(_module: Any) -> Any:
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


VERIFY_PATCHES: dict[bool, list[tuple[Callable[[Any], Any], str, Callable]]] = {
    False: [(lambda m: getattr(m, "PPOTrainer", None), "_compute_old_log_prob", wrap_v1_old_log_prob)],
    True: [
        (_rollout_corr, "apply_bypass_mode", wrap_bypass),
        (lambda m: m, "compute_data_metrics", wrap_data_metrics),
    ],
}
"""Per trainer kind (legacy?): ``(owner from the trainer module, attribute, wrapper factory)``."""
