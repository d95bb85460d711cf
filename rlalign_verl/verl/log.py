"""The verl plugin's logger: always visible at INFO, whatever verl sets on the root logger."""

from __future__ import annotations

from rlalign_verl.base.log import visible_logger

logger = visible_logger("rlalign_verl.verl")
