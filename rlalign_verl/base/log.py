"""Loggers of the integrations: visible at INFO whatever the host framework sets on the root logger."""

from __future__ import annotations

import logging
import re
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


_warned: set[tuple[str, str]] = set()


def warn_once(logger: logging.Logger, message: str) -> bool:
    """Log ``message`` as a warning the first time its kind is seen in this process (numbers in it do not make
    a new kind: "values up to 0.43" and "values up to 0.51" are one problem); True when it was logged."""
    key = (logger.name, re.sub(r"[-+]?\d[\d.e+-]*", "#", message))
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(message)
    return True
