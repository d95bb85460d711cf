"""In-run verification in OpenRLHF: the actor's log-probs recomputed with alignment switched off at verify steps.

OpenRLHF's experience maker (in the PPO trainer's Ray actor) computes the policy's log-probs with
``actor_model_group.async_run_method_batch(method_name="forward", ...)``: every model actor (DeepSpeed rank)
runs ``Actor.forward`` on its chunk. At a verify step the plugin asks the same group for the same forward again
after switching every model actor to a verify rung (:func:`set_rung`, run in each actor with Ray's
``__ray_call__``; the ``Actor.forward`` wrapper then runs under :func:`~rlalign_verl.align.patch.alignment_variant`), and
switches them back afterwards. The samples are OpenRLHF's own micro-batches, so the pair shares its micro-batching.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlalign_verl.base.options import spelled_as
from rlalign_verl.catalog.fingerprint import EngineFingerprint, fingerprint_for, unverified_line
from rlalign_verl.measure.verify import compare, ladder_metrics, ladder_rungs
from rlalign_verl.measure.verify_policy import Verifier
from rlalign_verl.openrlhf.experience_metrics import pad_cat
from rlalign_verl.openrlhf.log import logger
from rlalign_verl.openrlhf.settings import ROLLOUT, Settings

_RUNG: str | None = None
"""This model actor's verify rung while a verify pass runs (``"none"``, ``"rope"``, ...); ``None`` otherwise."""


def set_rung(_actor: Any, rung: str | None) -> int:
    """Run inside a model actor (``handle.__ray_call__.remote(set_rung, rung)``): its next forwards use ``rung``."""
    global _RUNG
    _RUNG = rung
    return os.getpid()


def wrap_actor_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Actor.forward`` that runs a verify pass with the rung's alignment variant."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _RUNG is None:
            return original(self, *args, **kwargs)
        from rlalign_verl.align.patch import alignment_variant

        with alignment_variant(self.model, _RUNG):
            return original(self, *args, **kwargs)

    return forward


def start(settings: Settings) -> Verifier | None:
    """The PPO trainer process's verification plan."""
    spec = settings.spec
    if not spec.regions:
        return None
    from rlalign_verl.catalog.profiles import get_profile

    try:  # the launcher's profile: OpenRLHF samples with vLLM on GPUs (vllm / vllm-eager) unless set explicitly
        profile = get_profile(spec.engine)
        fp = fingerprint_for(profile, ROLLOUT)
        name, unverified = profile.name, unverified_line(profile, fp) is not None
    except Exception as err:  # an unreadable fact: treat the engine as unverified
        fp, name, unverified = EngineFingerprint(ROLLOUT, None, "unknown", "unknown"), str(spec.engine), True
        logger.warning("cannot read the rollout engine's fingerprint (%s): verifying at step 1", err)
    return Verifier.start(spec, name, fp, unverified, logger)


def _subsample(experiences: Sequence[Any], cap: int, actors: int) -> list[Any]:
    """Whole micro-batches holding at least ``cap`` sequences (all when they hold fewer), their number rounded UP to
    a multiple of the actor count (at least one each): rounded down, the sample could fall below the 8 sequences a
    verdict needs (``cap`` >= 8)."""
    chosen, seqs = 0, 0
    for e in experiences:
        if seqs >= cap:
            break
        chosen += 1
        seqs += int(e.sequences.shape[0])
    return list(experiences[: -(-chosen // actors) * actors])


def _pass(maker: Any, experiences: Sequence[Any], rung: str) -> list[torch.Tensor]:
    import ray

    group = maker.actor_model_group
    handles = list(group._actor_handlers)
    args = maker.strategy.args
    duplicate = int(args.ds.ring_attn_size) * int(args.ds.tensor_parallel_size)
    ray.get([h.__ray_call__.remote(set_rung, rung) for h in handles])
    try:
        refs = group.async_run_method_batch(
            method_name="forward",
            sequences=[e.sequences for e in experiences],
            action_mask=[e.action_mask for e in experiences],
            attention_mask=[e.attention_mask for e in experiences],
        )
        return list(itertools.chain.from_iterable(ray.get(refs)[::duplicate]))
    finally:
        ray.get([h.__ray_call__.remote(set_rung, None) for h in handles])


def verify_step(verifier: Verifier, maker: Any, experiences: Sequence[Any], step: int) -> dict[str, float]:
    """Both passes on this step's experiences; the ``mismatch/verify/*`` metrics (``{}`` without rollout log-probs)."""
    if not experiences or getattr(experiences[0], "rollout_log_probs", None) is None:
        verifier.warn_skipped(
            ValueError("no rollout log-probs (turn on --alignment.collect_rollout_logprobs true)")
        )
        return {}
    actors = len(maker.actor_model_group._actor_handlers) // max(1, maker.actor_model_group.duplicate_actors)
    sub = _subsample(experiences, verifier.spec.verify.max_seqs, max(1, actors))
    unaligned = _pass(maker, sub, "none")
    aligned = pad_cat([e.action_log_probs for e in sub], torch.float32)
    rollout = pad_cat([e.rollout_log_probs for e in sub], torch.float32)
    mask = pad_cat([e.action_mask for e in sub], torch.float32)
    ladder = {}
    if verifier.spec.verify.ladder and not verifier.first_done:
        passes = {"all": aligned, "none": pad_cat(unaligned, torch.float32)}
        for rung in ladder_rungs(verifier.spec)[1:]:
            passes[rung] = pad_cat(_pass(maker, sub, rung), torch.float32)
        ladder = ladder_metrics(passes, rollout, mask)
    result = compare(aligned, pad_cat(unaligned, torch.float32), rollout, mask, seed=step)
    with spelled_as("flag"):  # the fix named as the launcher's --alignment.* flag
        return verifier.record(step, result, ladder)
