"""The one input check of every public function that takes per-token log-probs and a response mask.

:func:`~rlalign_verl.measure.metrics.compute_mismatch_metrics`, :func:`~rlalign_verl.measure.doctor.signatures`,
:meth:`~rlalign_verl.measure.doctor.Doctor.step`, :func:`~rlalign_verl.measure.turns.round_metrics`,
:func:`~rlalign_verl.measure.verify.compare` and :func:`~rlalign_verl.measure.verify.ladder_metrics` call :func:`check_log_probs`
first, so that a bad input gets the same typed error, :class:`~rlalign_verl.base.errors.MetricsInputError` (a
``ValueError``), wherever it enters: one line that starts with the function's name and names the fix. Refused:

- a log-prob or mask that is not a ``torch.Tensor`` (a list, a numpy array, ``None``: never converted silently),
  a complex tensor, a meta tensor (no data);
- tensors that are not all of one 2-D ``[batch, response_len]`` shape;
- log-probs that are not floating point (an int tensor is token ids, a bool tensor a mask);
- a mask holding anything but 0 and 1 (0.5, 2, -1, NaN): such an entry is not "a response token";
- on the response tokens (mask 1), a finite log-prob above :data:`MAX_LOG_PROB`; when no finite one is negative
  and none is above 1 the tensor is named as probabilities (pass ``log(p)``).

Not refused: NaN and ±inf log-probs on response tokens. A trainer that diverges produces them; the metrics leave
those tokens out and count them (``mismatch/nonfinite_tokens``, ``mismatch/doctor/nonfinite_tokens``), so a step
with a few of them keeps its numbers and a step with only them still logs the count, every step. Refusing them
would drop the whole step's metrics exactly when they matter, and say so only once (the in-run callers warn once
per kind of problem). Masked-out positions (padding) may hold anything.

The scalar arguments of the same functions (seeds, counts, windows, switches, key prefixes, settings
mappings) go through :func:`check_int`, :func:`check_bool`, :func:`check_str`, :func:`check_number` and
:func:`check_mapping`: the same error, one line naming the argument the caller passed and the fix. Nothing is
coerced: ``"5"``, ``1.5``, ``True`` for a count, ``"false"`` for a switch and ``None`` for a prefix are refused.

Cost: the structure checks read no data; the value checks are a few elementwise passes and reductions per tensor
and one device-to-host transfer for all of them (no Python loop over tokens).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from rlalign_verl.base.errors import MetricsInputError

__all__ = [
    "MAX_LOG_PROB",
    "check_tensor",
    "check_shapes",
    "check_structure",
    "check_mask",
    "check_log_probs",
    "check_ids",
    "check_step",
    "check_int",
    "check_bool",
    "check_str",
    "check_number",
    "check_mapping",
    "input_error",
]

MAX_LOG_PROB = 1e-3
"""The largest log-prob accepted on a response token. A log-softmax is <= 0; rounding (bf16, fp16, fp32) leaves
it at most a few ulp of 0 above 0, far below 1e-3, while a probability of a sampled token (often > 0.1) and a logit
are far above: the tolerance keeps a rounded 0 from being refused and lets nothing else through."""


def input_error(where: str, msg: str) -> MetricsInputError:
    """The one error of this module: ``<where>: <msg>`` (raise it)."""
    return MetricsInputError(f"{where}: {msg}")


_fail = input_error


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def check_tensor(where: str, name: str, value: Any, what: str = "log-probs") -> torch.Tensor:
    """``value`` itself when it is a real tensor holding data; else :class:`MetricsInputError`."""
    if not isinstance(value, torch.Tensor):
        raise _fail(where, f"{name} is a {type(value).__name__}, not a torch.Tensor; "
                    f"convert it with torch.as_tensor({name})")  # fmt: skip
    if value.is_complex() or value.device.type == "meta":
        raise _fail(where, f"{name} is a {_dtype(value)} tensor on {value.device}; pass real {what} holding data "
                    f"(e.g. {name}.float() on cpu or cuda)")  # fmt: skip
    return value


def check_shapes(where: str, tensors: Mapping[str, Any]) -> tuple[int, ...]:
    """The one 2-D ``[batch, response_len]`` shape of ``tensors`` (each checked by :func:`check_tensor`)."""
    for name, value in tensors.items():
        check_tensor(where, name, value)
    shapes = [tuple(t.shape) for t in tensors.values()]
    if len(set(shapes)) != 1 or len(shapes[0]) != 2:
        raise _fail(where, f"{_listed(list(tensors))} must share one [batch, response_len] shape, got "
                    f"{_listed([str(s) for s in shapes])}; pass the response part only (verl: batch['old_log_probs'], "
                    "batch['rollout_log_probs'], batch['response_mask'])")  # fmt: skip
    return shapes[0]


def check_structure(where: str, log_probs: Mapping[str, Any], mask_name: str, mask: Any) -> tuple[int, ...]:
    """Tensors, one 2-D shape (returned), floating-point log-probs: the checks that read no values."""
    check_tensor(where, mask_name, mask, what="mask values")
    shape = check_shapes(where, {**log_probs, mask_name: mask})
    for name, value in log_probs.items():
        if not value.is_floating_point():
            raise _fail(where, f"{name} is a {_dtype(value)} tensor; log-probs are floating point: pass the "
                        "per-token log-probs themselves, not token ids or a mask")  # fmt: skip
    return shape


def _mask_fault(mask: torch.Tensor) -> torch.Tensor:
    """0-d count of mask entries other than 0 and 1 (NaN included); no work for a bool mask."""
    if mask.dtype is torch.bool:
        return torch.zeros((), dtype=torch.int64, device=mask.device)
    return (~((mask == 0) | (mask == 1))).sum()


def _mask_line(name: str, bad: int) -> str:
    return (f"{name} has {bad} value(s) other than 0 and 1 (e.g. 0.5, 2, -1 or NaN); pass a 0/1 (or bool) mask of "
            f"the response tokens, e.g. ({name} > 0)")  # fmt: skip


def check_mask(where: str, name: str, mask: Any) -> torch.Tensor:
    """``mask`` when it is a 2-D tensor of 0/1 (or bool) values; else :class:`MetricsInputError`."""
    check_tensor(where, name, mask, what="mask values")
    if mask.ndim != 2:
        raise _fail(where, f"{name} must be [batch, response_len], got shape {tuple(mask.shape)}; pass the "
                    "response part only (verl: batch['response_mask'])")  # fmt: skip
    bad = int(_mask_fault(mask.detach()))
    if bad:
        raise _fail(where, _mask_line(name, bad))
    return mask


def check_log_probs(where: str, log_probs: Mapping[str, Any], mask_name: str, mask: Any) -> None:
    """Every check of the module docstring on ``log_probs`` (name -> tensor) and their mask.

    Raises :class:`MetricsInputError` with one line starting ``<where>:``. Valid inputs are only read.
    """
    check_structure(where, log_probs, mask_name, mask)
    mask = mask.detach()
    if mask.numel() == 0:
        return
    on = mask if mask.dtype is torch.bool else mask != 0
    first = next(iter(log_probs.values())).device
    work = torch.float32 if first.type == "mps" else torch.float64  # MPS has no float64
    parts = [_mask_fault(mask)]
    for value in log_probs.values():
        x = value.detach()
        finite = on.to(x.device) & torch.isfinite(x)
        parts += [torch.where(finite, x, float("-inf")).amax(), (finite & (x < 0)).any()]
    values = torch.stack([p.to(first, work) for p in parts]).tolist()  # the one device -> host transfer
    if values[0]:
        raise _fail(where, _mask_line(mask_name, int(values[0])))
    for i, name in enumerate(log_probs):
        top, negative = values[1 + 2 * i], values[2 + 2 * i]
        if top <= MAX_LOG_PROB:
            continue
        if not negative and top <= 1.0 + MAX_LOG_PROB:
            raise _fail(where, f"{name} has values up to {top:.4g} on response tokens, all in [0, 1]: "
                        f"probabilities, not log-probs; pass log(p) (e.g. {name}.log())")  # fmt: skip
        raise _fail(where, f"{name} has values up to {top:.4g} > 0 on response tokens; log-probs are <= 0 (up to "
                    f"{MAX_LOG_PROB:g} of rounding): pass log-probs, not logits or log-ratios")  # fmt: skip


def check_ids(where: str, name: str, ids: Any, shape: tuple[int, ...], hint: str = "") -> torch.Tensor:
    """``ids`` when it is an integer token-id tensor of ``shape``; else :class:`MetricsInputError`."""
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(shape):
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise _fail(
            where, f"{name} must be a {tuple(shape)} token-id tensor like the log-probs{hint}, got {got}"
        )
    if ids.is_floating_point() or ids.is_complex():
        raise _fail(where, f"{name} is {_dtype(ids)}; pass token ids{hint}, not log-probs")
    return ids


def check_step(where: str, step: Any) -> int:
    """``step`` as an ``int`` when it is an integer (Python, numpy or 0-d torch), not a bool."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()
    return check_int(where, "step", step, fix="pass the training step number (e.g. trainer.global_steps)")


def _kind(value: Any) -> str:
    name = type(value).__name__
    return f"{value!r:.40} is {'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def check_int(
    where: str, name: str, value: Any, *, minimum: int | None = None, hint: str = "", fix: str = ""
) -> int:
    """``value`` as an ``int`` when it is an integer (Python or numpy; not a bool) >= ``minimum``.

    The message's fix is ``fix`` or ``give an int >= minimum``, followed by ``hint`` (e.g. ``" (default 20)"``).
    """
    fix = (fix or "give an int" + ("" if minimum is None else f" >= {minimum}")) + hint
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(where, f"{name}={_kind(value)}, not an int; {fix}")
    if minimum is not None and value < minimum:
        raise _fail(where, f"{name}={int(value)} is below {minimum}; {fix}")
    return int(value)


def check_bool(where: str, name: str, value: Any, hint: str = "") -> bool:
    """``value`` when it is a ``bool`` (or a numpy bool): ``"false"``, ``0`` and ``None`` are not switches."""
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy
        value = bool(value)
    if not isinstance(value, bool):
        raise _fail(where, f"{name}={_kind(value)}, not a bool; give {name}=True or {name}=False{hint}")
    return value


def check_str(where: str, name: str, value: Any, hint: str = "") -> str:
    """``value`` when it is a ``str`` (a metric-key prefix, a name): ``None`` would spell ``"None..."`` keys."""
    if not isinstance(value, str):
        raise _fail(where, f"{name}={_kind(value)}, not a str; give a str{hint}")
    return value


def _span(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" in [{low:g}, {high:g}]"
    return f" >= {low:g}" if low is not None else (f" <= {high:g}" if high is not None else "")


def check_number(
    where: str, name: str, value: Any, *, low: float | None = None, high: float | None = None, hint: str = ""
) -> float:
    """``value`` as a finite ``float`` in ``[low, high]`` when it is a real number (not a bool, not a str)."""
    fix = f"give a finite number{_span(low, high)}{hint}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(where, f"{name}={_kind(value)}, not a number; {fix}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond float's range
        raise _fail(where, f"{name} is an integer beyond a float's range; {fix}") from None
    if not math.isfinite(out) or (low is not None and out < low) or (high is not None and out > high):
        raise _fail(where, f"{name}={out!r} is out of range; {fix}")
    return out


def check_mapping(where: str, name: str, value: Any, hint: str = "") -> Mapping:
    """``value`` when it is a mapping (a dict, an OmegaConf ``DictConfig``)."""
    if not isinstance(value, Mapping):
        raise _fail(where, f"{name} is a {type(value).__name__}, not a mapping; give a dict{hint}")
    return value
