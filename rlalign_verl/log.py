"""Loggers of the integrations: visible at INFO whatever the host framework sets on the root logger."""

from __future__ import annotations

import logging
import sys


def visible_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with its own ``[rlalign-verl]`` stderr handler at INFO (idempotent)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[rlalign-verl] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
