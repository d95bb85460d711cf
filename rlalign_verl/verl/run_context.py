"""The trainer run whose ``fit`` is executing in this context: its config, request and verification state.

Set by the wrapped ``fit`` (:mod:`.trainer_callback`) and read by the per-step hooks (mismatch metrics,
:mod:`.verify_hooks`); ``None`` outside ``fit`` or for a plain verl run without our ``alignment`` group.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlalign_verl.request.spec import AlignmentSpec


@dataclass
class Run:
    config: Any
    spec: AlignmentSpec
    trainer: Any
    legacy: bool
    """The legacy ``RayPPOTrainer`` (DataProto batches) rather than the v1 trainer (TransferQueue)."""
    verify: Any = None
    """The :class:`~rlalign_verl.measure.verify_policy.Verifier`, or ``None`` when nothing is verified."""
    doctor: Any = None
    """The :class:`~rlalign_verl.measure.doctor.Doctor`, or ``None`` when the doctor or the metrics are off."""
    group_ids: Any = None
    """v1 trainer: the step's GRPO group ids (TransferQueue's ``uid``), read before verl's debug-metrics hook runs
    (its batch carries no ``uid``); ``None`` between steps."""


_ACTIVE: contextvars.ContextVar[Run | None] = contextvars.ContextVar("rlalign_verl_run", default=None)


def active() -> Run | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def running(run: Run) -> Iterator[Run]:
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)
