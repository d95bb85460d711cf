"""How an alignment error ends a verl run: one line and exit code 2, not Hydra's traceback."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rlalign_verl.base.errors import exit_on_error


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Inside a Hydra job (a verl entry point): an ``AlignmentError`` becomes one ``[rlalign-verl] ERROR``
    line on stderr and ``exit(2)``. ``HYDRA_FULL_ERROR=1`` (Hydra's own switch) keeps the raw exception,
    and outside a Hydra job (a library call, a test) the exception propagates unchanged."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and os.environ.get("HYDRA_FULL_ERROR", "0") != "1":
        with exit_on_error(2):
            yield
    else:
        yield
