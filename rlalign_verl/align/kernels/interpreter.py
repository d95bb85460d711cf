"""Whether Triton runs its kernels in the CPU interpreter (the kernels round on the bits there)."""

from __future__ import annotations

import os


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
