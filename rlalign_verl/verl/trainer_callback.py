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

import contextvars
import functools
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rlalign_verl.errors import AlignmentError
from rlalign_verl.options import option_bool
from rlalign_verl.verl.log import logger as _plugin_logger

# A child of the plugin's logger (always visible at INFO, see rlalign_verl/verl/log.py).
logger = _plugin_logger.getChild("metrics")

__all__ = [
    "TRAINER_MODULES",
    "step_mismatch_metrics",
    "loggable",
    "install_trainer_callback",
    "uninstall_trainer_callback",
    "is_installed",
    "check_metrics_config",
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
_ORIGINAL = "__rlalign_original__"

# The config of the trainer whose (wrapped) fit() is running in this context; None outside fit().
_ACTIVE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "rlalign_verl_active_config", default=None
)
# (owner, attribute, original value, owner had its own attribute) per patch, for uninstall.
_PATCHES: dict[str, list[tuple[Any, str, Any, bool]]] = {}


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


def metrics_enabled(config: Any) -> bool:
    """True when the config has an ``alignment`` section whose ``metrics`` option is on (default on)."""
    alignment = _cfg_get(config, "alignment")
    if alignment is None:
        return False
    return option_bool(_cfg_get(alignment, "metrics"), name="alignment.metrics", default=True)


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
    ``metrics`` (default true) and ``metrics_quantiles`` (default true) from ``config.alignment``.
    Never raises.
    """
    try:
        if not metrics_enabled(config):
            return {}
        from rlalign_verl.metrics import compute_mismatch_metrics

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
        clip, low, high = _clip_range(config)
        out = compute_mismatch_metrics(
            train,
            rollout,
            mask,
            clip_ratio=clip,
            clip_ratio_low=low,
            clip_ratio_high=high,
            quantiles=option_bool(
                _cfg_get(config, "alignment.metrics_quantiles"),
                name="alignment.metrics_quantiles",
                default=True,
            ),
        )
        if out.get("mismatch/num_tokens", 0) == 0 and out.get("mismatch/nonfinite_tokens", 0) > 0:
            logger.warning(
                "all %d response tokens of this step have a NaN/inf log-prob (trainer or "
                "rollout); only the counts are logged",
                out["mismatch/nonfinite_tokens"],
            )
        return loggable(out)
    except Exception as exc:  # never stop training
        logger.warning("mismatch metrics skipped for this step: %s: %s", type(exc).__name__, exc)
        return {}


def check_metrics_config(config: Any) -> None:
    """Raise ``AlignmentError`` when mismatch metrics are on but the rollout does not return log-probs."""
    if not metrics_enabled(config):
        return
    option_bool(
        _cfg_get(config, "alignment.metrics_quantiles"), name="alignment.metrics_quantiles", default=True
    )
    if not _log_probs_on(config):
        raise AlignmentError(
            "alignment.metrics=true needs the rollout log-probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True (or alignment.metrics=false)."
        )


def _start_run(config: Any) -> Any:
    """Log the active alignment once per fit(); return the config when metrics are on, else None."""
    try:
        alignment = _cfg_get(config, "alignment")
        if alignment is None:
            return None
        regions = _cfg_get(alignment, "regions", [])
        regions = [regions] if isinstance(regions, str) else list(regions)
        # The driver writes the resolved profile (engine=auto -> a name) into the model's override_config.
        profile = _cfg_get(config, "actor_rollout_ref.model.override_config.rlalign_engine")
        if profile is None or str(profile) == "auto":  # baseline (regions=[]): name what would be used
            from .config import would_use_profile

            profile = would_use_profile(config)
        on = metrics_enabled(config)
        logger.info(
            "alignment regions=%s profile=%s; mismatch metrics (mismatch/*) %s",
            ",".join(map(str, regions)) or "none (baseline)",
            profile,
            "on" if on else "off",
        )
        if not on:
            return None
        if not _log_probs_on(config):
            logger.warning(
                "actor_rollout_ref.rollout.calculate_log_probs is off: no mismatch/* metrics "
                "will be logged; set actor_rollout_ref.rollout.calculate_log_probs=True"
            )
        if _cfg_get(config, "algorithm.rollout_correction.bypass_mode", False):
            logger.warning(
                "algorithm.rollout_correction.bypass_mode=True: verl does not recompute "
                "old_log_probs, so no mismatch/* metrics are logged (see rollout_corr/* instead)"
            )
        return config
    except Exception as exc:
        logger.warning("mismatch metrics disabled for this run: %s: %s", type(exc).__name__, exc)
        return None


def _wrap_hook(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def calculate_debug_metrics(data: Any, *args: Any, **kwargs: Any) -> dict:
        result = original(data, *args, **kwargs)
        config = _ACTIVE_CONFIG.get()
        if config is not None:
            extra = loggable(step_mismatch_metrics(data, config))
            # add, never overwrite: verl's own keys (e.g. training/rollout_probs_diff_mean) stay as they are
            extra = {k: v for k, v in extra.items() if k not in result}
            if extra:
                result = {**result, **extra}
        return result

    setattr(calculate_debug_metrics, _ORIGINAL, original)
    return calculate_debug_metrics


def _wrap_fit(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = _start_run(getattr(self, "config", None))
        if config is None:
            return original(self, *args, **kwargs)
        token = _ACTIVE_CONFIG.set(config)
        try:
            return original(self, *args, **kwargs)
        finally:
            _ACTIVE_CONFIG.reset(token)

    setattr(fit, _ORIGINAL, original)
    return fit


def _patch(module_name: str, owner: Any, attr: str, wrap: Callable[[Any], Any]) -> None:
    patches = _PATCHES.setdefault(module_name, [])
    if any(p[0] is owner and p[1] == attr for p in patches):
        return  # installed already
    own = attr in vars(owner)
    current = vars(owner)[attr] if own else getattr(owner, attr)
    if hasattr(current, _ORIGINAL):
        # Bound to a wrapper made by another install call (v1's trainer_base binds the function at import
        # time, possibly after the legacy install wrapped it): keep it, remember the original for uninstall.
        patches.append((owner, attr, getattr(current, _ORIGINAL), own))
        return
    setattr(owner, attr, wrap(current))
    patches.append((owner, attr, current, own))


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
        _patch(name, cls, "fit", _wrap_fit)
        _patch(name, hook_owner, _HOOK, _wrap_hook)
        return True
    except Exception as exc:
        logger.warning("could not install the mismatch-metrics callback in %s: %s", name, exc)
        return False


def uninstall_trainer_callback(module: ModuleType) -> bool:
    """Undo ``install_trainer_callback(module)``; False when nothing was installed there."""
    patches = _PATCHES.pop(getattr(module, "__name__", ""), [])
    for owner, attr, original, own in reversed(patches):
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
    return bool(patches)


def is_installed(module: ModuleType) -> bool:
    """True when ``module``'s trainer ``fit`` is currently wrapped by this callback."""
    cls = getattr(module, _TRAINER_CLASS.get(getattr(module, "__name__", ""), ""), None)
    return isinstance(cls, type) and hasattr(cls.__dict__.get("fit"), _ORIGINAL)
