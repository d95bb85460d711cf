"""Errors of the CPU adaptations."""

from __future__ import annotations


class TargetMovedError(RuntimeError):
    """An upstream function or class a CPU adaptation patches is gone (verl or vLLM changed)."""
