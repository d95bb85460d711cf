"""``mismatch/*`` metrics on OpenRLHF ``Experience`` objects, logged through OpenRLHF's own loggers.

After ``RemoteExperienceMaker.make_experience_batch`` every experience holds the training side's
recomputed log-probs (``action_log_probs``), the vLLM rollout log-probs (``rollout_log_probs``, present
when vLLM was asked for them) and ``action_mask``. The metrics are computed once over *all*
experiences of the step with :func:`rlalign_verl.measure.metrics.compute_mismatch_metrics` and attached to
each experience as a per-sample ``(B,)`` tensor in ``experience.info``.

How OpenRLHF reduces them: ``PolicyModelActor.ppo_train`` treats every ``(B,)`` info tensor as a
per-sample metric, takes the sample-weighted mean over micro-batches, epochs and data-parallel ranks
(all-reduce) and logs it as ``train/<key>``. The plugin stores the step's statistic as the *same value
for every sample*, so that mean is exactly the step's statistic, however OpenRLHF splits, shuffles,
balances or drops samples: ``train/mismatch/logp_abs_diff_mean`` is the token mean over the whole step,
``train/mismatch/ratio_max`` the step's maximum, ``train/mismatch/num_tokens`` the step's token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlalign_verl.measure.metrics import compute_mismatch_metrics
from rlalign_verl.measure.tensor_inputs import check_structure


def pad_cat(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Right-pad ``(B_i, A_i)`` tensors with zeros to one width and concatenate them along dim 0."""
    width = max(t.shape[1] for t in tensors)
    rows = [torch.nn.functional.pad(t.detach().to("cpu", dtype), (0, width - t.shape[1])) for t in tensors]
    return torch.cat(rows, dim=0)


def step_mismatch_metrics(
    experiences: Sequence[Any], *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2
) -> dict[str, float] | None:
    """The ``mismatch/*`` statistics over all ``experiences`` of one step.

    ``None`` when no experience carries rollout log-probs (vLLM was not asked for them). Raises
    :class:`~rlalign_verl.base.errors.MetricsInputError` (a ``ValueError``) on malformed inputs
    (:func:`step_tensors`, :func:`~rlalign_verl.measure.tensor_inputs.check_log_probs`).
    """
    usable = [
        e
        for e in experiences
        if getattr(e, "rollout_log_probs", None) is not None
        and getattr(e, "action_log_probs", None) is not None
    ]
    if not usable:
        return None
    train, rollout, mask = step_tensors(usable)
    return compute_mismatch_metrics(
        train, rollout, mask, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high
    )


def step_tensors(usable: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(trainer log-probs, rollout log-probs, mask)`` of the step, right-padded to one width (float32).

    Each experience's tensors are checked first (:func:`~rlalign_verl.measure.tensor_inputs.check_structure`: tensors of
    one 2-D shape, floating-point log-probs), before the float32 padding could hide token ids; the values are
    checked on the padded step by the metrics.
    """
    for i, e in enumerate(usable):
        logp = {"action_log_probs": e.action_log_probs, "rollout_log_probs": e.rollout_log_probs}
        check_structure(f"openrlhf experience {i}", logp, "action_mask", getattr(e, "action_mask", None))
    train = pad_cat([e.action_log_probs for e in usable], torch.float32)
    rollout = pad_cat([e.rollout_log_probs for e in usable], torch.float32)
    mask = pad_cat([e.action_mask for e in usable], torch.float32)
    return train, rollout, mask


def step_doctor_metrics(
    experiences: Sequence[Any], doctor: Any, step: int
) -> tuple[dict[str, float], list[str]]:
    """``mismatch/doctor/*`` of one step and the doctor's lines due now (``({}, [])`` without rollout log-probs)."""
    usable = [e for e in experiences if getattr(e, "rollout_log_probs", None) is not None
              and getattr(e, "action_log_probs", None) is not None]  # fmt: skip
    if not usable:
        return {}, []
    train, rollout, mask = step_tensors(usable)
    return doctor.step(step, train, rollout, mask)


def attach_metrics(experiences: Sequence[Any], metrics: dict[str, float]) -> None:
    """Store each metric in every experience's ``info`` as a constant ``(B,)`` float tensor."""
    for e in experiences:
        batch = int(e.sequences.shape[0])
        for key, value in metrics.items():
            e.info[key] = torch.full((batch,), float(value), dtype=torch.float32)
