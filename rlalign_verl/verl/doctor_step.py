"""The doctor's per-step part in verl's trainer: ``mismatch/doctor/*`` from the step's batch, and its lines.

Multi-turn batches (verl's agent loop) also get per-round ``mismatch/round_{k}/*``. The legacy trainer's batches
also get the token-identity share ``mismatch/doctor/token_id_mismatch`` (``input_ids``' response part vs
``responses``: 0 in verl's own rollouts, which build one from the other; nonzero when a custom rollout or agent loop
builds them apart); the v1 trainer keeps no ``input_ids`` (it scores ``prompts`` + ``responses``). The v1 trainer's
batch has no ``uid`` either: the group ids for the duplicate rate are read from TransferQueue
(:func:`v1_group_ids`).

Runs beside the ``mismatch/*`` metrics (:mod:`.trainer_callback`) on the tensors already in the batch; never
raises (a metrics problem must never stop a training step). What each key means: :mod:`rlalign_verl.measure.doctor`
and docs/reading-a-mismatch.md.
"""

from __future__ import annotations

from typing import Any

from rlalign_verl.base.log import warn_once
from rlalign_verl.verl.log import logger as _plugin_logger

logger = _plugin_logger.getChild("doctor")


def step_tensors(batch: Any) -> tuple[Any, Any, Any, Any]:
    """``(old_log_probs, rollout_log_probs, response_mask, tensors)`` of a verl ``DataProto`` step batch.

    The mask is ``response_mask``, else the response part of ``attention_mask``. Raises ``ValueError`` naming
    what is missing.
    """
    tensors = getattr(batch, "batch", None)
    if tensors is None:
        raise ValueError(f"expected a verl DataProto with a tensor batch, got {type(batch).__name__}")
    keys = set(tensors.keys())
    missing = [k for k in ("old_log_probs", "rollout_log_probs") if k not in keys]
    if missing:
        raise ValueError(
            f"batch has no {' / '.join(missing)} (keys: {sorted(keys)}); "
            "set actor_rollout_ref.rollout.calculate_log_probs=True"
        )
    train, rollout = tensors["old_log_probs"], tensors["rollout_log_probs"]
    if "response_mask" in keys:
        mask = tensors["response_mask"]
    elif "attention_mask" in keys and train.ndim == 2:
        mask = tensors["attention_mask"][:, -train.shape[-1] :]
    else:
        raise ValueError(f"batch has neither response_mask nor attention_mask (keys: {sorted(keys)})")
    return train, rollout, mask, tensors


def start_doctor(config: Any, spec: Any) -> Any:
    """The run's :class:`~rlalign_verl.measure.doctor.Doctor` (``None`` when the doctor or the metrics are off)."""
    if not (spec.doctor.enable and spec.metrics):
        return None
    from rlalign_verl.measure.doctor import Doctor
    from rlalign_verl.verl.doctor_config import doctor_context

    return Doctor(doctor_context(config))


def v1_group_ids(meta: Any) -> Any:
    """The GRPO group id of each sequence of a v1 step (``KVBatchMeta``), in the step's key order.

    verl's v1 trainer hands its debug-metrics hook a batch of tensors only; the group ids live in TransferQueue's
    ``uid`` field. ``None`` (said once) when they cannot be read: the duplicate rate is then skipped.
    """
    try:
        import numpy as np

        from rlalign_verl.verl.verify_run import v1_read

        return np.array(v1_read(meta, ["uid"]).pop("uid").tolist(), dtype=object)
    except Exception as exc:
        warn_once(
            logger, f"mismatch/doctor/dup_rate skipped (group ids unreadable: {type(exc).__name__}: {exc})"
        )
        return None


def doctor_step(doctor: Any, batch: Any, step: int, group_ids: Any = None) -> dict[str, float]:
    """``mismatch/doctor/*`` of one step batch; logs the verdict lines that are due; ``{}`` on any failure.

    ``group_ids``: the GRPO group id per sequence when the batch has no ``non_tensor_batch['uid']`` (v1 trainer).
    """
    try:
        train, rollout, mask, tensors = step_tensors(batch)
        uid = (getattr(batch, "non_tensor_batch", None) or {}).get("uid")
        uid = group_ids if uid is None else uid
        responses = tensors["responses"] if uid is not None and "responses" in set(tensors.keys()) else None
        ids, width = {}, train.shape[-1] if train.ndim == 2 else 0
        if width and {"input_ids", "responses"} <= set(tensors.keys()):
            # verl forwards input_ids = [prompt | response] and scores the response part; its own rollouts build
            # input_ids from responses, so this differs only where a custom rollout or agent loop built them apart
            trainer_ids, rollout_ids = tensors["input_ids"][:, -width:], tensors["responses"]
            if tuple(trainer_ids.shape) == tuple(rollout_ids.shape) == tuple(train.shape):
                ids = {"trainer_ids": trainer_ids, "rollout_ids": rollout_ids}
        sig, lines = doctor.step(step, train, rollout, mask, uid=uid if responses is not None else None,
                                 responses=responses, **ids)  # fmt: skip
        for line in lines:
            logger.warning("doctor: %s", line)
        return sig
    except Exception as exc:  # never stop training; say each kind of problem once
        warn_once(logger, f"mismatch/doctor/* skipped ({type(exc).__name__}: {exc}); training continues")
        return {}
