"""Errors raised for bad input. Each message names the fix."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class AlignmentError(ValueError):
    """Base class of every configuration / input error raised by rlalign-verl."""


class UnknownRegionError(AlignmentError):
    """A region name that is not one of ``rlalign_verl.align.regions.REGIONS``."""


class UnknownProfileError(AlignmentError):
    """An engine profile name that is not in ``rlalign_verl.catalog.profiles.PROFILES``."""


class UnsupportedModelError(AlignmentError):
    """A model architecture with no entry in the family table."""


class LigerConflictError(AlignmentError):
    """The model (or its classes) was patched by Liger kernels, which replace the same forwards."""


class ProfileMismatchError(AlignmentError):
    """The requested engine profile contradicts the configured rollout engine."""


class RolloutFormatError(AlignmentError):
    """A rollout dump that cannot be used (malformed, inconsistent, or not fitting the model)."""


class EngineUnavailableError(AlignmentError):
    """The inference engine is not installed, or it failed to start / generate."""


class VocabularyMismatchError(AlignmentError):
    """The tokenizer and the model disagree on the vocabulary."""


class ConfigFormatError(AlignmentError):
    """A setting or file of the wrong type or shape (not a mapping, not a boolean, malformed JSON)."""


class ComputeDtypeError(AlignmentError):
    """An aligned region fed tensors that are not bf16: every profile mirrors a bf16 engine."""


class MetricsInputError(AlignmentError):
    """Inputs to the mismatch metrics that are not tensors of one ``[batch, response_len]`` shape."""


class AlignmentOverriddenError(AlignmentError):
    """Something (e.g. Liger kernels) replaced the aligned forwards after ``apply_alignment``."""


PREFIX = "[rlalign-verl] ERROR"


def one_line(err: BaseException) -> str:
    """``[rlalign-verl] ERROR <Type>: <message>`` on one line (newlines in the message folded)."""
    text = " ".join(str(err).split())
    return f"{PREFIX} {type(err).__name__}: {text}"


@contextlib.contextmanager
def exit_on_error(code: int = 2) -> Iterator[None]:
    """Turn an :class:`AlignmentError` raised inside into one :func:`one_line` on stderr and ``exit(code)``."""
    try:
        yield
    except AlignmentError as err:
        print(one_line(err), file=sys.stderr, flush=True)
        raise SystemExit(code) from None
