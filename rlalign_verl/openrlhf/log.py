"""The OpenRLHF integration's logger: visible at INFO in the driver and in every Ray worker."""

from __future__ import annotations

from ..log import visible_logger

logger = visible_logger("rlalign_verl.openrlhf")

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
