"""Mismatch metrics on every PPO/GRPO step of verl's trainer (runs in the TaskRunner process).

Where the metrics come from (verl 0.9.1): both trainers call ``calculate_debug_metrics(batch)`` once per
(mini-)step, right after ``old_log_probs`` were recomputed, with a ``DataProto`` holding ``old_log_probs``,
``rollout_log_probs`` and ``response_mask``, and merge its dict into the step's ``metrics`` that later
reaches ``Tracking.log``:

- v1 trainer: ``verl/trainer/ppo/v1/trainer_base.py::PPOTrainer._compute_old_log_prob`` calls the name
  ``calculate_debug_metrics`` bound in that module;
- legacy trainer: ``verl/trainer/ppo/ray_trainer.py::RayPPOTrainer.fit`` imports it from
  ``verl.utils.debug.metrics`` at call time.

``install_trainer_callback`` wraps that function (adding the ``mismatch/*`` keys to its result) and the
trainer's ``fit`` (which makes the run's config visible to the wrapper, logs the active alignment once and
switches the metrics on only when ``config.alignment.metrics`` is true). The batch is read, never
modified; the hook runs before verl's rollout correction (TIS/MIS) rewrites ``response_mask``, so
``mismatch/*`` covers every response token, like verl's ``training/rollout_probs_diff_*``. In rollout
correction's bypass mode verl does not recompute ``old_log_probs`` and no ``mismatch/*`` keys appear.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rlalign_verl.base.log import warn_once
from rlalign_verl.base.options import option_bool
from rlalign_verl.base.wrap_once import is_wrapped, unwrap, wrap_once
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.verl.doctor_step import doctor_step, start_doctor, step_tensors
from rlalign_verl.verl.log import logger as _plugin_logger
from rlalign_verl.verl.run_context import Run, active, running
from rlalign_verl.verl.transport import OVERRIDE_PATH, SPEC_KEY

# A child of the plugin's logger (always visible at INFO, see rlalign_verl/verl/log.py).
logger = _plugin_logger.getChild("metrics")

__all__ = [
    "TRAINER_MODULES",
    "step_mismatch_metrics",
    "loggable",
    "install_trainer_callback",
    "uninstall_trainer_callback",
    "is_installed",
    "metrics_enabled",
]

#: Modules whose import should trigger ``install_trainer_callback(module)``.
TRAINER_MODULES: tuple[str, ...] = ("verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.ray_trainer")

_TRAINER_CLASS = {
    "verl.trainer.ppo.v1.trainer_base": "PPOTrainer",
    "verl.trainer.ppo.ray_trainer": "RayPPOTrainer",
}
_DEBUG_METRICS_MODULE = "verl.utils.debug.metrics"
_HOOK = "calculate_debug_metrics"


def _cfg_get(node: Any, path: str, default: Any = None) -> Any:
    """``config.a.b.c`` for OmegaConf nodes, dicts or attribute objects; ``default`` when missing/None."""
    for key in path.split("."):
        if node is None:
            return default
        try:
            node = (
                node.get(key, None)
                if hasattr(node, "get") and hasattr(node, "keys")
                else getattr(node, key, None)
            )
        except Exception:
            return default
    return default if node is None else node


_run_specs: dict[int, tuple[Any, AlignmentSpec | None]] = {}
"""``id(config)`` -> (config, its spec): the request is read once per run config, not at every step."""


def run_spec(config: Any) -> AlignmentSpec | None:
    """The run's alignment request: the resolved spec the driver wrote, else the ``alignment`` node parsed;
    ``None`` for a plain verl run (no ``alignment`` group). Read once per config object (every step asks)."""
    hit = _run_specs.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    spec = None
    if _cfg_get(config, "alignment") is not None:
        raw = _cfg_get(config, f"{OVERRIDE_PATH}.{SPEC_KEY}")
        if raw is not None:
            spec = AlignmentSpec.from_json(raw if isinstance(raw, str) else _plain(raw))
        else:
            spec = AlignmentSpec.parse(_cfg_get(config, "alignment"), spelling="hydra")
    if len(_run_specs) > 64:  # tests build many configs; a run has one
        _run_specs.clear()
    _run_specs[id(config)] = (config, spec)
    return spec


def _plain(node: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except ImportError:  # pragma: no cover
        return node


def metrics_enabled(config: Any) -> bool:
    """True when the run has our ``alignment`` group with ``metrics`` on (default on)."""
    spec = run_spec(config)
    return spec is not None and spec.metrics


def _log_probs_on(config: Any) -> bool:
    name = "actor_rollout_ref.rollout.calculate_log_probs"
    return option_bool(_cfg_get(config, name), name=name, default=False)


def _clip_range(config: Any) -> tuple[float, float, float]:
    actor = _cfg_get(config, "actor_rollout_ref.actor")
    clip = float(_cfg_get(actor, "clip_ratio", 0.2))
    low = float(_cfg_get(actor, "clip_ratio_low", clip))
    high = float(_cfg_get(actor, "clip_ratio_high", clip))
    return clip, low, high


PREFIX = "mismatch/"


def loggable(metrics: dict[str, Any]) -> dict[str, float]:
    """The entries of ``metrics`` every verl logger accepts: ``mismatch/*`` keys with finite Python floats.

    Tensors (0-d or one element), numpy and Python numbers become ``float``; other keys, non-numbers and
    NaN/inf are dropped with one warning naming them.
    """
    out: dict[str, float] = {}
    dropped = []
    for key, value in metrics.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            number = math.nan
        if isinstance(key, str) and key.startswith(PREFIX) and math.isfinite(number):
            out[key] = number
        else:
            dropped.append(f"{key}={value!r}"[:80])
    if dropped:
        logger.warning("dropped %d metric(s) that are not finite numbers under %s: %s", len(dropped), PREFIX,
                       ", ".join(dropped[:5]))  # fmt: skip
    return out


def step_mismatch_metrics(batch: Any, config: Any) -> dict[str, float]:
    """``mismatch/*`` metrics of one verl step batch (a ``DataProto``); ``{}`` (and a warning) on failure.

    Reads ``old_log_probs``, ``rollout_log_probs`` and ``response_mask`` (else the response part of
    ``attention_mask``) from ``batch.batch``; clip range from ``config.actor_rollout_ref.actor``; options
    ``metrics`` and ``experimental.metrics_quantiles`` from the run's spec. Never raises.
    """
    try:
        spec = run_spec(config)
        if spec is None or not spec.metrics:
            return {}
        from rlalign_verl.measure.metrics import all_nonfinite_line, compute_mismatch_metrics

        train, rollout, mask, _ = step_tensors(batch)
        clip, low, high = _clip_range(config)
        out = compute_mismatch_metrics(
            train,
            rollout,
            mask,
            clip_ratio=clip,
            clip_ratio_low=low,
            clip_ratio_high=high,
            quantiles=spec.experimental.metrics_quantiles,
        )
        line = all_nonfinite_line(out)
        if line:
            logger.warning("%s", line)
        return loggable(out)
    except Exception as exc:  # never stop training; say each kind of problem once, not every step
        warn_once(logger, f"mismatch metrics skipped ({type(exc).__name__}: {exc}); training continues")
        return {}


def _start_run(trainer: Any, legacy: bool) -> Run | None:
    """Log the active alignment once per fit(); the run's context when metrics or verification are on."""
    config = getattr(trainer, "config", None)
    try:
        spec = run_spec(config)
        if spec is None:
            return None
        profile = spec.engine
        if not spec.regions or profile == "auto":  # baseline (regions=[]): name what would be used
            from rlalign_verl.verl.config import would_use_profile

            profile = would_use_profile(config)
        logger.info(
            "alignment regions=%s profile=%s; mismatch metrics (mismatch/*) %s",
            ",".join(spec.regions) or "none (baseline)",
            profile,
            "on" if spec.metrics else "off",
        )
        run = Run(config, spec, trainer, legacy)
        try:
            from rlalign_verl.verl.verify_run import start_verify

            run.verify = start_verify(config, spec)
        except Exception as exc:  # never stop training for a check
            logger.warning("in-run verification off for this run: %s: %s", type(exc).__name__, exc)
        if not spec.metrics and run.verify is None:
            return None
        try:
            run.doctor = start_doctor(config, spec)
        except Exception as exc:  # never stop training for a check
            logger.warning("mismatch/doctor/* off for this run: %s: %s", type(exc).__name__, exc)
        if not _log_probs_on(config):
            logger.warning(
                "actor_rollout_ref.rollout.calculate_log_probs is off: no mismatch/* metrics "
                "will be logged; set actor_rollout_ref.rollout.calculate_log_probs=True"
            )
        if spec.metrics and _cfg_get(config, "algorithm.rollout_correction.bypass_mode", False):
            logger.warning(
                "algorithm.rollout_correction.bypass_mode=True: verl does not recompute old_log_probs, so no "
                "per-step mismatch/* metrics are logged (see rollout_corr/*); the verify steps still measure "
                "mismatch/verify/*"
            )
        return run
    except Exception as exc:
        logger.warning("mismatch metrics disabled for this run: %s: %s", type(exc).__name__, exc)
        return None


def _wrap_hook(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def calculate_debug_metrics(data: Any, *args: Any, **kwargs: Any) -> dict:
        result = original(data, *args, **kwargs)
        run = active()
        if run is None:
            return result
        extra = loggable(step_mismatch_metrics(data, run.config)) if run.spec.metrics else {}
        if run.doctor is not None:
            step = int(getattr(run.trainer, "global_steps", 0) or 0)
            extra.update(loggable(doctor_step(run.doctor, data, step, group_ids=run.group_ids)))
        if run.legacy and run.verify is not None:  # the legacy trainer verifies here, before the update
            from rlalign_verl.verl.verify_hooks import legacy_verify_step

            extra.update(legacy_verify_step(run, data, bypass=False))
        # add, never overwrite: verl's own keys (e.g. training/rollout_probs_diff_mean) stay as they are
        extra = {k: v for k, v in extra.items() if k not in result}
        return {**result, **extra} if extra else result

    return calculate_debug_metrics


def _wrap_fit(legacy: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
            run = _start_run(self, legacy)
            if run is None:
                return original(self, *args, **kwargs)
            with running(run):
                return original(self, *args, **kwargs)

        return fit

    return make


def install_trainer_callback(module: ModuleType) -> bool:
    """Patch the verl trainer class in ``module`` (one of ``TRAINER_MODULES``) to log ``mismatch/*``.

    Idempotent; undone by ``uninstall_trainer_callback``. Returns False (with a warning) when the module is
    not a known trainer module or this verl version lacks the expected class/function.
    """
    name = getattr(module, "__name__", repr(module))
    try:
        cls_name = _TRAINER_CLASS.get(name)
        if cls_name is None:
            logger.warning("%s is not a verl trainer module (%s)", name, ", ".join(TRAINER_MODULES))
            return False
        cls = getattr(module, cls_name, None)
        hook_owner = (
            module if name.endswith(".v1.trainer_base") else importlib.import_module(_DEBUG_METRICS_MODULE)
        )
        if (
            not isinstance(cls, type)
            or not callable(getattr(cls, "fit", None))
            or not callable(getattr(hook_owner, _HOOK, None))
        ):
            logger.warning(
                "%s.%s.fit or %s.%s not found in this verl version; mismatch metrics are off "
                "(rlalign-verl supports verl 0.9.x)",
                name,
                cls_name,
                hook_owner.__name__,
                _HOOK,
            )
            return False
        legacy = not name.endswith(".v1.trainer_base")
        wrap_once(cls, "fit", _wrap_fit(legacy), group=name)
        wrap_once(hook_owner, _HOOK, _wrap_hook, group=name)
        from rlalign_verl.verl.verify_hooks import VERIFY_PATCHES

        for owner_of, attr, wrap in VERIFY_PATCHES[legacy]:
            owner = owner_of(module)
            if owner is not None and callable(getattr(owner, attr, None)):
                wrap_once(owner, attr, wrap, group=name)
        return True
    except Exception as exc:
        logger.warning("could not install the mismatch-metrics callback in %s: %s", name, exc)
        return False


def uninstall_trainer_callback(module: ModuleType) -> bool:
    """Undo ``install_trainer_callback(module)``; False when nothing was installed there."""
    return unwrap(getattr(module, "__name__", ""))


def is_installed(module: ModuleType) -> bool:
    """True when ``module``'s trainer ``fit`` is currently wrapped by this callback."""
    cls = getattr(module, _TRAINER_CLASS.get(getattr(module, "__name__", ""), ""), None)
    return isinstance(cls, type) and is_wrapped(cls.__dict__.get("fit"))
