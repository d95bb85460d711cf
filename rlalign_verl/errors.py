"""Errors raised for bad input. Each message names the fix."""

from __future__ import annotations


class AlignmentError(ValueError):
    """Base class of every configuration / input error raised by rlalign-verl."""


class UnknownRegionError(AlignmentError):
    """A region name that is not one of ``rlalign_verl.regions.REGIONS``."""


class UnknownProfileError(AlignmentError):
    """An engine profile name that is not in ``rlalign_verl.profiles.PROFILES``."""


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
