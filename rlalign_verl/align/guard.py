"""Is an applied alignment still in place? Finds forwards replaced after ``apply_alignment``.

Liger's ``apply_liger_kernel_to_<family>(model=...)`` (and any other instance patch) binds its own
``forward`` on the MLPs and norms of an already aligned model; the model then no longer rounds like the
engine although its alignment state says it does. :func:`check_intact` turns that into an error.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from rlalign_verl.align.binding import SAVED_FORWARD, bound_origin
from rlalign_verl.base.errors import AlignmentOverriddenError, UnsupportedModelError

OURS = "rlalign_verl."
LIGER = "liger_kernel"


def replaced_forwards(model: nn.Module, expected: Iterable[type] = ()) -> list[str]:
    """``"<module name> (<where its forward comes from>)"`` for each module that lost its aligned forward.

    A module counts when the patcher bound its forward and something else replaced it, when it runs a
    Liger forward or is a Liger class, or when it is an instance of an ``expected`` class (one the
    patcher binds for the active regions) without the patcher's forward (e.g. swapped in afterwards).
    """
    expected = tuple(expected)
    replaced, around = [], []  # aligned forwards replaced first, then foreign ones next to them
    for name, m in model.named_modules():
        where = bound_origin(m.__dict__.get("forward"))
        label = name or type(m).__name__
        if SAVED_FORWARD in m.__dict__:
            if not where.startswith(OURS):
                replaced.append(f"{label} ({where or 'its class forward'})")
        elif where.startswith(LIGER) or type(m).__module__.startswith(LIGER):
            around.append(f"{label} ({where or type(m).__module__})")
        elif expected and isinstance(m, expected):
            replaced.append(f"{label} (a new {type(m).__name__} without the aligned forward)")
    return replaced + around


def check_intact(model: nn.Module, describe: str, expected: Iterable[type] = ()) -> None:
    """Raise :class:`AlignmentOverriddenError` when :func:`replaced_forwards` finds anything."""
    found = replaced_forwards(model, expected)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise AlignmentOverriddenError(
            f"the alignment of {type(model).__name__} ({describe}) was overridden after apply_alignment: {shown} "
            f"no longer run the aligned forward; build the model without that patch (Liger: verl "
            f"use_liger=False, OpenRLHF drop --ds.use_liger_kernel) and call apply_alignment again"
        )


def check_model_arg(model: object, function: str = "apply_alignment") -> None:
    """One-line error for a ``model`` argument that is not a module (a path, a state dict, a pipeline)."""
    if model is not None and not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"{function} needs a torch.nn.Module (a transformers model), got a {type(model).__name__}; "
            f"load it first, e.g. AutoModelForCausalLM.from_pretrained(path)"
        )
