"""``install()``: the plugin's patches in one OpenRLHF process (the driver or any Ray worker).

The launcher passes :data:`HOOK` to Ray as ``worker_process_setup_hook``, so every task/actor worker of
the job runs :func:`install` at start-up with the settings the launcher put in the env vars
(:class:`~rlalign_verl.openrlhf.settings.Settings`); the launcher also calls it in the driver. It is
idempotent and does, depending on the settings:

- regions set: wraps ``openrlhf.models.actor.Actor.__init__``. OpenRLHF builds the policy, the reference
  and the EMA model with this class (critic and reward models use another builder and stay as they
  are); after the original ``__init__`` has loaded the HF model, and before DeepSpeed wraps it, the
  model is aligned with :func:`rlalign_verl.align.patch.align_on_worker`. One log line per aligned model.
  Before the checkpoint loads, the profile is checked against the worker's device
  (:func:`placed_profile`, :mod:`rlalign_verl.catalog.placement`).
  ``use_liger_kernel=True`` is refused (``LigerConflictError``).
- metrics on: wraps ``RemoteExperienceMaker.make_experience_batch`` to add the ``mismatch/*`` metrics
  (:mod:`rlalign_verl.openrlhf.experience_metrics`). Any failure there is a warning, never an error.
- collect_rollout_logprobs on (measure-only): vLLM is asked for the sampled tokens' log-probs
  (``SamplingParams(logprobs=1)``, ``logprobs_mode="processed_logprobs"``) even when OpenRLHF's IS
  correction is off. The loss does not change: OpenRLHF's ``PolicyLoss`` reads ``rollout_log_probs``
  only when ``--algo.advantage.is_correction_level`` is not ``off``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rlalign_verl.base.errors import LigerConflictError
from rlalign_verl.base.import_hooks import when_imported
from rlalign_verl.base.wrap_once import wrap_once
from rlalign_verl.openrlhf.log import logger, warn_once
from rlalign_verl.openrlhf.settings import ROLLOUT, Settings, get_arg
from rlalign_verl.request.checks import validate_request

HOOK = "rlalign_verl.openrlhf.setup.install"
"""The ``worker_process_setup_hook`` string the launcher hands to Ray."""

_active: Settings | None = None

# Modules that build vLLM SamplingParams for rollouts (0.11.x first; older releases built them in the
# experience maker).
_SAMPLING_MODULES = (
    "openrlhf.trainer.ppo_utils.samples_generator",
    "openrlhf.trainer.ppo_utils.experience_maker",
)


def active_settings() -> Settings | None:
    """The settings :func:`install` last activated in this process (``None``: plugin inactive)."""
    return _active


def install(settings: Settings | None = None) -> Settings | None:
    """Activate the plugin in this process; ``settings`` default to the launcher's env vars.

    Without settings (the env vars are absent: not started by our launcher) this does nothing and
    returns ``None``. Import-light: each patch is applied when its OpenRLHF module is imported (at
    once if it already is), so a worker that never loads OpenRLHF's models pays nothing.
    """
    global _active, _verifier, _steps, _doctor, _doctor_steps
    if settings is None:
        settings = Settings.from_env()
    if settings is None:
        return None
    _active = settings
    _verifier, _steps = None, 0  # a new run's verification starts over
    _doctor, _doctor_steps = None, 0
    if settings.regions:
        when_imported("openrlhf.models.actor", _patch_actor)
    if settings.metrics or settings.regions:  # the metrics, and the in-run verification of an aligned run
        when_imported(
            "openrlhf.trainer.ppo_utils.experience_maker",
            _guarded("the mismatch metrics", _patch_experience_maker),
        )
    if settings.collect_rollout_logprobs:
        for name in _SAMPLING_MODULES:
            when_imported(name, _guarded("collecting rollout log-probs", _patch_sampling_module))
        when_imported(
            "openrlhf.trainer.ray.vllm_engine", _guarded("collecting rollout log-probs", _patch_engine_module)
        )
    return settings


def _guarded(what: str, fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def run(module: ModuleType) -> None:
        try:
            fn(module)
        except Exception as exc:  # the metrics path never stops training
            warn_once(f"could not set up {what} ({type(exc).__name__}: {exc}); training continues without it")

    return run


# --- alignment of the policy / reference / EMA Actor ---------------------------------------------


def _caller_role() -> str:
    """Which OpenRLHF model actor is building this ``Actor`` (for the log line)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            name = type(owner).__name__ if owner is not None else ""
            if name.endswith("ModelActor"):
                ema = "actor" in frame.f_locals and frame.f_code.co_name == "init_model_from_pretrained"
                return f"{name} (EMA)" if ema else name
            frame = frame.f_back
        return "Actor"
    finally:
        del frame


def placed_profile(settings: Settings, device_type: str) -> str:
    """The profile a worker on ``device_type`` aligns to; raises ``ProfileMismatchError`` naming the fix.

    ``--alignment.engine auto`` moves the driver's choice to this device's build; an explicit profile for
    another device, or ``hf`` (OpenRLHF always samples with vLLM), is an error.
    """
    profile = validate_request(settings.spec, device=device_type, rollout=ROLLOUT, spelling="flag")
    name = settings.profile if profile is None else profile.name
    if name != settings.profile:
        logger.info(
            "--alignment.engine auto: profile %s (chosen on the driver) is %s on this worker",
            settings.profile,
            name,
        )
    return name


def align_actor(actor: Any, settings: Settings, profile: str | None = None) -> Any:
    """Align ``actor.model`` (an OpenRLHF ``Actor``'s HF model, LoRA-wrapped or not) in place.

    ``profile``: the one :func:`placed_profile` settled for this worker (default: checked here).
    """
    from rlalign_verl.align.patch import align_on_worker
    from rlalign_verl.catalog.placement import worker_device_type

    model = actor.model
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = worker_device_type(hf_model)
    spec = settings.spec if profile is None else settings.spec.replace(engine=profile)
    # the request against this model (architecture, dtype) and device; errors spelled as --alignment.* flags
    state = align_on_worker(hf_model, spec, device=device, spelling="flag")
    logger.info(
        "aligned %s for %s (pid %d): %s",
        type(hf_model).__name__,
        _caller_role(),
        os.getpid(),
        state.describe() if state is not None else "no change",
    )
    return hf_model


def _patch_actor(module: ModuleType) -> None:
    from rlalign_verl.openrlhf.verify import wrap_actor_forward

    wrap_once(module.Actor, "__init__", _aligning_init)
    wrap_once(module.Actor, "forward", wrap_actor_forward)  # verify passes: alignment switched off on request


def _aligning_init(original: Callable[..., None]) -> Callable[..., None]:
    """``Actor.__init__`` that aligns the model it built (refusing Liger) while regions are set."""
    signature = inspect.signature(original)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = _active
        if settings is None or not settings.regions:
            original(self, *args, **kwargs)
            return
        try:
            use_liger = signature.bind(self, *args, **kwargs).arguments.get("use_liger_kernel", False)
        except TypeError:
            use_liger = kwargs.get("use_liger_kernel", False)
        if use_liger:
            raise LigerConflictError(
                "OpenRLHF builds this Actor with use_liger_kernel=True (--ds.use_liger_kernel), whose Liger "
                "kernels replace the RoPE/RMSNorm/SwiGLU forwards that alignment patches; drop "
                "--ds.use_liger_kernel or turn alignment off (--alignment.regions none)"
            )
        from rlalign_verl.catalog.placement import worker_device_type

        profile = placed_profile(settings, worker_device_type())  # before the checkpoint loads
        original(self, *args, **kwargs)
        align_actor(self, settings, profile)

    return __init__


# --- mismatch metrics ------------------------------------------------------------------------------


def _clip_range(args: Any) -> tuple[float, float]:
    low_high = get_arg(args, "actor.eps_clip_low_high", "eps_clip_low_high")
    if low_high is not None and len(low_high) == 2:
        return float(low_high[0]), float(low_high[1])
    eps = float(get_arg(args, "actor.eps_clip", "eps_clip", default=0.2))
    return eps, eps


def add_step_metrics(experiences: list, args: Any) -> dict[str, float] | None:
    """Compute and attach the step's ``mismatch/*`` metrics; warn (never raise) on any failure."""
    from rlalign_verl.measure.metrics import all_nonfinite_line
    from rlalign_verl.openrlhf.experience_metrics import attach_metrics, step_mismatch_metrics

    try:
        low, high = _clip_range(args)
        metrics = step_mismatch_metrics(experiences, clip_ratio_low=low, clip_ratio_high=high)
        if metrics is None:
            warn_once(
                "no rollout log-probs in the experiences, so no mismatch/* metrics: turn on "
                "--alignment.collect_rollout_logprobs true (measure only, the loss is unchanged) or OpenRLHF's "
                "IS correction (--algo.advantage.is_correction_level token)"
            )
            return None
        attach_metrics(experiences, metrics)
        line = all_nonfinite_line(metrics)
        if line:
            logger.warning("%s", line)
        if _active is not None and _active.spec.doctor.enable:
            metrics = {**metrics, **_add_doctor_metrics(experiences, args)}
        return metrics
    except Exception as exc:  # never stop training for a metric
        warn_once(f"mismatch metrics skipped ({type(exc).__name__}: {exc})")
        return None


_doctor: Any = None
_doctor_steps = 0


def _add_doctor_metrics(experiences: list, args: Any) -> dict[str, float]:
    """``mismatch/doctor/*`` (:mod:`rlalign_verl.measure.doctor`) on the experiences, and its lines; never raises."""
    global _doctor, _doctor_steps
    from rlalign_verl.measure.doctor import Doctor
    from rlalign_verl.openrlhf.experience_metrics import attach_metrics, step_doctor_metrics

    try:
        if _doctor is None:
            _doctor = Doctor({"temperature": float(get_arg(args, "rollout.temperature", "temperature", default=1.0)),
                              "top_p": float(get_arg(args, "rollout.top_p", "top_p", default=1.0))})  # fmt: skip
        _doctor_steps += 1
        sig, lines = step_doctor_metrics(experiences, _doctor, _doctor_steps)
        for line in lines:
            logger.warning("doctor: %s", line)
        attach_metrics(experiences, sig)
        return sig
    except Exception as exc:  # never stop training for a metric
        warn_once(f"mismatch/doctor/* skipped ({type(exc).__name__}: {exc})")
        return {}


_verifier: Any = None
_steps = 0


def add_verify_metrics(maker: Any, experiences: list) -> dict[str, float]:
    """At a verify step, both passes and their ``mismatch/verify/*`` on the experiences (``{}`` otherwise).

    A failure warns and skips the check; a separated "worse" under ``on_worse=stop`` stops the run (raises).
    """
    global _verifier, _steps
    from rlalign_verl.measure.verify import VerifyFailedError
    from rlalign_verl.openrlhf.experience_metrics import attach_metrics
    from rlalign_verl.openrlhf.verify import start, verify_step

    _steps += 1
    try:
        if _verifier is None:
            _verifier = start(_active) or False
        if not _verifier or not _verifier.due(_steps):
            return {}
        metrics = verify_step(_verifier, maker, experiences, _steps)
        attach_metrics(experiences, metrics)
        return metrics
    except VerifyFailedError:
        raise
    except Exception as exc:  # never stop training for a metric
        warn_once(f"in-run verification skipped ({type(exc).__name__}: {exc})")
        return {}


def _patch_experience_maker(module: ModuleType) -> None:
    wrap_once(module.RemoteExperienceMaker, "make_experience_batch", _with_step_metrics)


def _with_step_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    """``make_experience_batch`` that attaches the ``mismatch/*`` metrics while metrics are on."""

    def make_experience_batch(self, *args: Any, **kwargs: Any):
        experiences = original(self, *args, **kwargs)
        if _active is not None and _active.metrics:
            add_step_metrics(experiences, getattr(self, "args", None) or self.strategy.args)
        if _active is not None and _active.regions:
            add_verify_metrics(self, experiences)
        return experiences

    return make_experience_batch


# --- measure-only: rollout log-probs without IS correction ---------------------------------------


def _collecting() -> bool:
    return _active is not None and _active.collect_rollout_logprobs


def sampling_params_with_logprobs(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``SamplingParams`` constructor: while measure-only is on, ``logprobs=None`` becomes ``1``."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        if _collecting() and kwargs.get("logprobs") is None and not args:
            kwargs["logprobs"] = 1
        return factory(*args, **kwargs)

    return build


def engines_with_logprobs_mode(create: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``create_vllm_engines``: while measure-only is on, vLLM returns processed (temperature-applied)
    log-probs (``logprobs_mode="processed_logprobs"``, what OpenRLHF asks for with IS correction)."""
    signature = inspect.signature(create)

    @functools.wraps(create)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _collecting() and "logprobs_mode" in signature.parameters:
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("logprobs_mode") is None:
                bound.arguments["logprobs_mode"] = "processed_logprobs"
            return create(*bound.args, **bound.kwargs)
        return create(*args, **kwargs)

    return wrapped


def _patch_sampling_module(module: ModuleType) -> None:
    wrap_once(module, "SamplingParams", sampling_params_with_logprobs)


def _patch_engine_module(module: ModuleType) -> None:
    create = module.create_vllm_engines
    if not wrap_once(module, "create_vllm_engines", engines_with_logprobs_mode):
        return
    # openrlhf.trainer.ray re-exports it (``from .vllm_engine import create_vllm_engines``), and
    # train_ppo_ray imports it from there; if the package finished importing already, rebind it too.
    package = sys.modules.get("openrlhf.trainer.ray")
    if package is not None and getattr(package, "create_vllm_engines", None) is create:
        package.create_vllm_engines = module.create_vllm_engines
