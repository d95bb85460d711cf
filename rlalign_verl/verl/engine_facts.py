"""The rollout engine a verl run really uses, read from its config and environment (:class:`EngineFingerprint`).

Shared by the driver (one start-up line when the profile was never verified on this engine) and the trainer
process (which then verifies at step 1 even with ``alignment.verify.enable=false``).
"""

from __future__ import annotations

import os
from typing import Any

from rlalign_verl.base.errors import ProfileMismatchError
from rlalign_verl.catalog.fingerprint import EngineFingerprint, fingerprint_for, unverified_line
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.verl.config_access import select as _select
from rlalign_verl.verl.log import logger

VLLM_KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm"


WORKER_DEVICES = ("cuda", "cpu")
"""The ``trainer.device`` values a profile describes (vLLM/SGLang on CUDA, vLLM's CPU build)."""


def workers_device(config: Any) -> str:
    """Where the actor and the rollout run: ``cpu`` with the CPU adaptations, else verl's ``trainer.device``
    (default ``cuda``); another accelerator (``npu``) is refused in one line: no profile describes its kernels."""
    from rlalign_verl.verl.cpu import enabled

    if enabled():
        return "cpu"
    device = str(_select(config, "trainer.device") or "cuda").strip().lower()
    if device not in WORKER_DEVICES:
        raise ProfileMismatchError(
            f"trainer.device={device}: the engine profiles describe vLLM and SGLang on CUDA and vLLM's CPU build, "
            f"not the {device} engine's kernels, so alignment cannot mirror its rounding; set alignment.regions=[] "
            "(the mismatch metrics still work)"
        )
    return device


def workers_profile(config: Any, spec: AlignmentSpec) -> str:
    """The profile the workers align to, as the start-up line names it: ``spec``'s, or, where ``auto`` resolved on a
    driver of another device, the workers' device's build and why."""
    try:
        placed = placed_profile(config, spec).name
    except (
        ProfileMismatchError
    ):  # an explicit profile for the other device: the worker refuses it where it runs
        return str(spec.engine)
    if placed == spec.engine:
        return placed
    device = workers_device(config)
    return f"{placed} (the workers run on {device}: auto moves {spec.engine}, chosen on this driver, to that build)"


def placed_profile(config: Any, spec: AlignmentSpec) -> Any:
    """The profile the workers align to: ``spec``'s, ``auto`` placed on the workers' device as each worker does."""
    from rlalign_verl.catalog.placement import profile_for_device

    return profile_for_device(spec.engine, workers_device(config), auto=spec.engine_auto)


def run_fingerprint(config: Any, spec: AlignmentSpec) -> tuple[EngineFingerprint, Any]:
    """``(fingerprint, profile)``: the run's engine and the profile its workers align to (``auto`` placed on the
    workers' device, as each worker does)."""
    from rlalign_verl.verl.head_dtype import engine_head_dtype

    profile = placed_profile(config, spec)
    head, _ = engine_head_dtype(config) if _select(config, "actor_rollout_ref") is not None else (None, "")
    backend = _select(config, f"{VLLM_KWARGS}.attention_backend") or os.environ.get("VLLM_ATTENTION_BACKEND")
    fp = fingerprint_for(
        profile,
        spec.rollout or str(_select(config, "actor_rollout_ref.rollout.name") or ""),
        attention_backend=None if backend is None else str(backend),
        head_dtype=head or "model",
        model_impl=None
        if _select(config, f"{VLLM_KWARGS}.model_impl") is None
        else str(_select(config, f"{VLLM_KWARGS}.model_impl")),
    )
    return fp, profile


def say_unverified_engine(config: Any, spec: AlignmentSpec) -> bool:
    """Log one line when the run's profile was never verified on its engine; returns whether it was not."""
    try:
        fp, profile = run_fingerprint(config, spec)
    except Exception as err:  # a fact we cannot read is not a reason to stop the run here
        logger.warning(
            "could not read the rollout engine's fingerprint (%s): the run verifies at step 1", err
        )
        return True
    line = unverified_line(profile, fp)
    if line is None:
        return False
    if spec.verify.enable:
        logger.warning("%s", line)
    elif spec.verify.skip_unverified_engine:
        logger.warning(
            "%s; SKIPPED at your request (alignment.verify.skip_unverified_engine=true): nothing in this run checks "
            "that alignment brings the trainer closer to the engine",
            line.split(": the run checks", 1)[0],
        )
    else:
        logger.warning("%s (forced although alignment.verify.enable=false; opt out: "
                       "alignment.verify.skip_unverified_engine=true)", line)  # fmt: skip
    return True
