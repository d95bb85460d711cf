"""Driver side of in-run verification in verl's trainers (runs in the TaskRunner process, inside ``fit``).

At a due step (:func:`rlalign_verl.measure.verify.schedule`) and before the actor update, the trainer asks the actor
worker group for the log-probs of up to ``verify.max_seqs`` sequences of the step's batch a second time, with
alignment switched off (:mod:`.verify_worker`), and compares both with the rollout's log-probs
(:func:`rlalign_verl.measure.verify.compare`). Where the batch is larger than ``max_seqs`` both passes run on the same
subsample, so the pair shares its micro-batching; otherwise the step's own ``old_log_probs`` are the aligned pass.
In rollout-correction bypass mode (no recompute) both passes run here.

- v1 trainer: ``PPOTrainer._compute_old_log_prob`` (TransferQueue: the passes read ``log_probs`` back by key);
- legacy trainer: from the ``calculate_debug_metrics`` hook (the batch then holds ``old_log_probs``), and in
  bypass mode from ``rollout_corr_helper.apply_bypass_mode``; the legacy metrics reach the step through the
  ``compute_data_metrics`` hook.

A failure here warns and skips the check (a metrics problem never stops training); a separated "worse" verdict
under ``on_worse=stop`` stops the run before the update with one line naming the fix.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from rlalign_verl.base.options import spelled_as
from rlalign_verl.catalog.fingerprint import EngineFingerprint, unverified_line
from rlalign_verl.measure.verify import VerifyFailedError, compare, ladder_metrics, ladder_rungs
from rlalign_verl.measure.verify_policy import Verifier
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.verl.log import logger
from rlalign_verl.verl.verify_worker import VERIFY_KEY


def start_verify(config: Any, spec: AlignmentSpec | None) -> Verifier | None:
    """The run's verification plan (``None``: nothing to verify); says once when it is forced or skipped."""
    if spec is None or not spec.regions:
        return None
    from rlalign_verl.verl.engine_facts import run_fingerprint

    try:
        fp, profile = run_fingerprint(config, spec)
        name, unverified = profile.name, unverified_line(profile, fp) is not None
    except Exception as err:  # an unreadable fact: treat the engine as unverified (verify at step 1)
        logger.warning("cannot read the rollout engine's fingerprint (%s): verifying at step 1", err)
        fp = EngineFingerprint(spec.rollout or "unknown", None, "unknown", "unknown")
        name, unverified = str(getattr(spec.engine, "name", spec.engine)), True
    return Verifier.start(spec, name, fp, unverified, logger)


# --- the legacy trainer: DataProto batches ---------------------------------------------------------------


def _legacy_pass(trainer: Any, batch: Any, rung: str | None) -> torch.Tensor:
    """``old_log_probs`` of ``batch`` from the trainer's own recompute path, with a verify rung (``None``: aligned)."""
    from verl import DataProto

    meta = dict(batch.meta_info)
    if rung is not None:
        meta[VERIFY_KEY] = rung
    sub = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info=meta)
    out = trainer._compute_old_log_prob(sub)
    out = out[0] if isinstance(out, tuple) else out
    return out.batch["old_log_probs"].float()


def _subsample(n: int, cap: int, multiple: int) -> int:
    """How many sequences to recompute: all when ``n <= cap``, else ``cap`` rounded UP to a multiple of the
    data-parallel size (rounded down, 8 sequences over 3 ranks would be 6: below the 8 a verdict needs)."""
    if n <= cap:
        return n
    return min(n, -(-cap // multiple) * multiple)


def legacy_verify(run: Verifier, trainer: Any, batch: Any, *, bypass: bool) -> dict[str, float]:
    """Both passes on a legacy-trainer batch (``old_log_probs`` present unless ``bypass``); the metrics."""
    step = int(getattr(trainer, "global_steps", 0))
    dp = _legacy_dp(trainer)
    k = _subsample(len(batch), run.spec.verify.max_seqs, dp)
    sub = batch if k == len(batch) else batch[:k]
    rollout = sub.batch["rollout_log_probs"].float()
    mask = sub.batch["response_mask"]
    aligned = (
        sub.batch["old_log_probs"].float()
        if not bypass and k == len(batch)
        else _legacy_pass(trainer, sub, None)
    )
    unaligned = _legacy_pass(trainer, sub, "none")
    ladder = {}
    if run.spec.verify.ladder and not run.first_done:
        passes = {"all": aligned, "none": unaligned}
        for rung in ladder_rungs(run.spec)[1:]:
            passes[rung] = _legacy_pass(trainer, sub, rung)
        ladder = ladder_metrics(passes, rollout, mask)
    result = compare(aligned, unaligned, rollout, mask, seed=step)
    with spelled_as("hydra"):  # the fix named as the verl key
        return run.record(step, result, ladder)


def _legacy_dp(trainer: Any) -> int:
    try:
        return int(trainer._get_dp_size(trainer.actor_rollout_wg, "actor"))
    except Exception:
        return 1


# --- the v1 trainer: TransferQueue batches ----------------------------------------------------------------


def _v1_dp(trainer: Any) -> int:
    try:
        wg = trainer.actor_rollout_wg
        mapping = wg._dispatch_info.get("actor") or wg._query_dispatch_info("actor")
        return max(mapping) + 1
    except Exception:
        return 1


def _v1_pass(trainer: Any, sub: Any, rung: str | None) -> None:
    from transfer_queue import KVBatchMeta

    extra = {**(sub.extra_info or {}), "calculate_entropy": False, "compute_loss": False}
    extra["temperature"] = trainer.config.actor_rollout_ref.rollout.temperature
    if rung is not None:
        extra[VERIFY_KEY] = rung
    meta = KVBatchMeta(
        keys=list(sub.keys), tags=list(sub.tags), partition_id=sub.partition_id, extra_info=extra
    )
    trainer.actor_rollout_wg.compute_log_prob(meta)


def v1_read(sub: Any, fields: list[str]) -> Any:
    """``fields`` of the v1 step's sequences ``sub`` (a ``KVBatchMeta``), from TransferQueue, in its key order."""
    import transfer_queue as tq

    return tq.kv_batch_get(keys=list(sub.keys), partition_id=sub.partition_id, select_fields=fields)


def _v1_log_probs(trainer: Any, sub: Any, rung: str | None) -> Any:
    """The response-level (nested) log-probs of one pass over ``sub``."""
    from verl.workers.utils.padding import response_from_nested

    _v1_pass(trainer, sub, rung)
    data = v1_read(sub, ["log_probs", "response_mask"])
    return response_from_nested(data["log_probs"], data["response_mask"])


def v1_verify(run: Verifier, trainer: Any, batch: Any, *, bypass: bool) -> dict[str, float]:
    """Both passes on a v1-trainer batch (TransferQueue keys); the metrics."""
    from tensordict import TensorDict

    step = int(getattr(trainer, "global_steps", 0))
    real = [i for i, tag in enumerate(batch.tags) if not (tag or {}).get("is_padding", False)]
    k = _subsample(len(batch), run.spec.verify.max_seqs, _v1_dp(trainer))
    whole = k == len(batch)
    if whole:
        sub = batch
    else:
        keep = (real + [i for i in range(len(batch)) if i not in set(real)])[:k]
        sub = batch.select_keys([batch.keys[i] for i in keep])
    base = v1_read(
        sub, ["rollout_log_probs", "response_mask"] + ([] if bypass or not whole else ["old_log_probs"])
    )
    fields = {"rollout": base["rollout_log_probs"], "mask": base["response_mask"]}
    fields["aligned"] = base["old_log_probs"] if whole and not bypass else _v1_log_probs(trainer, sub, None)
    fields["unaligned"] = _v1_log_probs(trainer, sub, "none")
    rungs = ladder_rungs(run.spec)[1:] if run.spec.verify.ladder and not run.first_done else []
    for rung in rungs:
        fields[f"rung_{rung}"] = _v1_log_probs(trainer, sub, rung)
    padded = TensorDict(fields, batch_size=len(sub)).to_padded_tensor()
    padding = [i for i, tag in enumerate(sub.tags) if (tag or {}).get("is_padding", False)]
    mask = padded["mask"].clone()
    mask[padding] = 0
    rollout = padded["rollout"].float()
    ladder = {}
    if rungs or (run.spec.verify.ladder and not run.first_done):
        passes = {"all": padded["aligned"].float(), "none": padded["unaligned"].float()}
        passes.update({r: padded[f"rung_{r}"].float() for r in rungs})
        ladder = ladder_metrics(passes, rollout, mask)
    result = compare(padded["aligned"].float(), padded["unaligned"].float(), rollout, mask, seed=step)
    with spelled_as("hydra"):  # the fix named as the verl key
        return run.record(step, result, ladder)


SECONDS_KEY = "mismatch/verify/seconds"
"""Wall time of the verify step's extra work (the passes and the comparison): its cost next to timing_s/step."""


def guarded(run: Verifier, fn: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
    """``fn(...)`` and its wall time; a verdict that stops the run propagates, any other failure warns and gives
    ``{}``."""
    try:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        out = {k: v for k, v in out.items() if math.isfinite(v)}
        if out:
            out[SECONDS_KEY] = time.perf_counter() - start
        return out
    except VerifyFailedError:
        raise
    except Exception as err:  # never stop training for a metric
        run.warn_skipped(err)
        return {}
