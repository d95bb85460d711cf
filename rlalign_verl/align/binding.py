"""How an aligned forward sits on a module instance: picklable, eager under ``torch.compile``, checkpointed
where transformers would checkpoint the layer, and readable under every KV-cache keyword.

- :class:`AlignedForward` is what ``module.forward`` holds (through ``functools.partial(obj, module)``): a
  factory and its (picklable) arguments; the forward itself is built on first use. ``torch.save``/``pickle``/
  ``copy.deepcopy`` of an aligned model therefore give an aligned model (a bound method of a closure would
  pickle as ``getattr(module, "forward")`` and come back as the class's unaligned forward).
- Under ``torch.compile`` (the whole model, or one layer) the aligned forward runs eagerly
  (:func:`run_eagerly`): Inductor drops the bf16 casts inside fused kernels, so a compiled region would round
  where HF's compiled graph rounds, not where the engine does. One log line says so.
- transformers >= 5.23 checkpoints decoder layers through a wrapper on the *class* ``forward`` (not
  ``__call__``); an instance forward bypasses it. :func:`checkpointed` does what that wrapper does.
- transformers >= 5.24 hands layers and attention the KV cache as ``cache=`` (before: ``past_key_values=``):
  :func:`pop_cache` reads either.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("rlalign_verl")

SAVED_FORWARD = "_rlalign_saved_forward"
"""Instance attribute holding what ``forward`` was before the patcher bound one (``None``: the class's)."""
CACHE_KWARGS = ("cache", "past_key_values")
"""The KV cache's keyword in transformers >= 5.24 and before."""


class AlignedForward:
    """``factory(*args)`` -> ``forward(module, ...)``, built lazily; pickles as ``(factory, args)``.

    ``factory`` must be a module-level function and ``args`` picklable (profiles, states, module references).
    """

    def __init__(self, factory: Callable[..., Callable], *args: Any) -> None:
        self.factory = factory
        self.args = args
        self._fn: Callable | None = None

    def __getstate__(self) -> dict:
        return {"factory": self.factory, "args": self.args}

    def __setstate__(self, state: dict) -> None:
        self.factory, self.args, self._fn = state["factory"], state["args"], None

    def build(self) -> Callable:
        if self._fn is None:
            self._fn = self.factory(*self.args)
        return self._fn

    @property
    def __signature__(self) -> inspect.Signature:  # what inspect.signature(module.forward) reports
        return inspect.signature(self.build())

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn if self._fn is not None else self.build()
        if torch.compiler.is_compiling():
            return run_eagerly(fn, module, args, kwargs)
        return fn(module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"AlignedForward({getattr(self.factory, '__qualname__', self.factory)})"


_said_compiled = False


@torch.compiler.disable
def run_eagerly(fn: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run an aligned forward outside the compiled graph (Dynamo breaks the graph here)."""
    global _said_compiled
    if not _said_compiled:
        _said_compiled = True
        logger.warning(
            "torch.compile on an aligned model: its aligned modules run eagerly, because Inductor would drop the "
            "bf16 roundings alignment places; the rest compiles. For compiled regions use "
            "alignment.experimental.compile=true (apply_alignment(..., compile=True))"
        )
    return fn(module, *args, **kwargs)


def bind(module: nn.Module, factory: Callable[..., Callable], *args: Any) -> None:
    """Make ``module.forward`` the aligned forward ``factory(*args)`` (remembering the previous one)."""
    if SAVED_FORWARD not in module.__dict__:
        module.__dict__[SAVED_FORWARD] = module.__dict__.get("forward")
    module.forward = functools.partial(AlignedForward(factory, *args), module)


def unbind(module: nn.Module) -> None:
    """Restore the forward :func:`bind` replaced."""
    if SAVED_FORWARD not in module.__dict__:
        return
    saved = module.__dict__.pop(SAVED_FORWARD)
    if saved is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


def bound_origin(fn: object) -> str:
    """The module that defined a (bound, partial or :class:`AlignedForward`) forward; ``""`` when unknown."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, AlignedForward):
        fn = fn.factory
    func = getattr(fn, "__func__", fn)
    return getattr(func, "__module__", None) or ""


def original_forward(module: nn.Module) -> Callable:
    """The forward :func:`bind` replaced, bound: an earlier instance forward, else the class's (in transformers
    >= 5.23 the class forward is the checkpointing wrapper)."""
    saved = module.__dict__.get(SAVED_FORWARD)
    return saved if saved is not None else type(module).forward.__get__(module)


def passthrough_forward() -> Callable:
    """A forward that calls the original one: bound on unaligned decoder layers and base models so that under
    ``torch.compile`` they too run eagerly and keep the rounding of the eager model they are part of."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original_forward(self)(*args, **kwargs)

    return forward


# --- transformers' gradient checkpointing (>= 5.23: a wrapper on the class forward) ------------------

try:
    from transformers.modeling_layers import GradientCheckpointingLayer as _GCL
except ImportError:  # pragma: no cover - transformers < 5 is not supported
    _GCL = None

HF_CHECKPOINTS_CLASS_FORWARD = _GCL is not None and "__call__" not in _GCL.__dict__
"""transformers >= 5.23 checkpoints in the class ``forward``; before, ``__call__`` checkpointed ``self.forward``."""


def checkpointed(impl: Callable) -> Callable:
    """``impl(self, hidden_states, ...)`` for a decoder layer, checkpointed exactly when transformers would.

    Up to 5.22 ``GradientCheckpointingLayer.__call__`` wraps whatever ``self.forward`` is, so ``impl`` is
    returned as is. From 5.23 the checkpoint lives on the class ``forward``, which an instance forward never
    calls, so this does what that wrapper does: when the layer's ``gradient_checkpointing`` flag is on, in
    training with grad enabled, drop the cache and run ``impl`` under the model's ``_gradient_checkpointing_func``.
    """
    if not HF_CHECKPOINTS_CLASS_FORWARD:
        return impl

    @functools.wraps(impl)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
            if not getattr(self, "_can_checkpoint_with_cache", False):
                kwargs["use_cache"] = False
                for key in CACHE_KWARGS:
                    if kwargs.get(key) is not None:
                        kwargs[key] = None
            return self._gradient_checkpointing_func(functools.partial(impl, self, **kwargs), *args)
        return impl(self, *args, **kwargs)

    return forward


def pop_cache(kwargs: dict, past_key_values: Any = None) -> Any:
    """The KV cache a layer / attention received under either keyword (removed from ``kwargs``)."""
    cache = kwargs.pop("cache", None)
    return past_key_values if past_key_values is not None else cache


@functools.cache
def cache_kwarg(cls: type) -> str:
    """The keyword ``cls.forward`` takes its KV cache under (``cache`` from transformers 5.24 on)."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
