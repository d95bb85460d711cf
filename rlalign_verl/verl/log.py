"""The plugin's logger: always visible at INFO, whatever verl sets on the root logger."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("rlalign_verl.verl")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[rlalign-verl] %(levelname)s %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
