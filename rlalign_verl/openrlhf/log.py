"""The OpenRLHF integration's logger: visible at INFO in the driver and in every Ray worker."""

from __future__ import annotations

from rlalign_verl.base import log

logger = log.visible_logger("rlalign_verl.openrlhf")


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time its kind is seen in this process (:func:`log.warn_once`)."""
    log.warn_once(logger, message)
