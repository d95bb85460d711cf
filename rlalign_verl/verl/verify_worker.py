"""Worker side of in-run verification: a log-prob pass with alignment switched off (or a ladder rung).

The driver marks a verify pass with one non-tensor entry in the batch, :data:`VERIFY_KEY` (``"none"``: no region
aligned; ``"rope"``, ``"rope,swiglu"`` ...: only those). verl hands a batch's non-tensor entries to the worker
(``tu.assign_non_tensor`` in the legacy trainer, ``KVBatchMeta.extra_info`` in the v1 trainer), and every
actor/ref log-prob pass goes through ``TrainingWorker.infer_batch`` (``verl/workers/engine_workers.py``). The
wrapper below runs that pass inside :func:`~rlalign_verl.align.patch.alignment_variant` on the engine's module: same
micro-batching, forward only, and afterwards exactly the forwards the model had (bit-identical outputs). A pass
without the entry runs as before: no extra work on other steps.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rlalign_verl.base.wrap_once import wrap_once
from rlalign_verl.verl.log import logger

WORKERS_MODULE = "verl.workers.engine_workers"
VERIFY_KEY = "rlalign_verify"
"""Non-tensor batch entry naming the regions of a verify pass (``"none"``: unaligned)."""


def _pop_flag(data: Any) -> str | None:
    try:
        from verl.utils import tensordict_utils as tu

        return tu.pop(data, key=VERIFY_KEY, default=None)
    except Exception:  # not a TensorDict / no such entry: an ordinary pass
        return None


def wrap_training_worker(module: ModuleType) -> None:
    """Wrap ``TrainingWorker.infer_batch`` so a marked pass runs with the requested alignment variant."""
    cls = getattr(module, "TrainingWorker", None)
    if cls is None or not callable(getattr(cls, "infer_batch", None)):
        logger.warning(
            "%s.TrainingWorker.infer_batch not found (verl version?): in-run verification cannot switch "
            "alignment off in the workers; set alignment.verify.enable=false",
            module.__name__,
        )
        return

    def make(original: Any) -> Any:
        def infer_batch(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
            rung = _pop_flag(data)
            if rung is None:
                return original(self, data, *args, **kwargs)
            from rlalign_verl.align.patch import alignment_variant

            model = getattr(getattr(self, "engine", None), "module", None)
            if model is None:
                raise RuntimeError("verify pass: this worker's engine has no module to switch")
            with alignment_variant(model, str(rung)):
                return original(self, data, *args, **kwargs)

        return infer_batch

    wrap_once(cls, "infer_batch", make)
