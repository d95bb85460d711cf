"""The OpenRLHF integration's logger: visible at INFO in the driver and in every Ray worker."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("rlalign_verl.openrlhf")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[rlalign-verl] %(levelname)s %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
