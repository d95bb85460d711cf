"""The rounding regions: each a plain differentiable function parameterised by a profile (one module each).

Their names and :func:`normalize_regions` belong to the request (:mod:`rlalign_verl.request.values`) and are
re-exported here.
"""

from __future__ import annotations

from rlalign_verl.request.values import ALL_REGIONS, OPT_IN_REGIONS, REGIONS, normalize_regions

__all__ = ["ALL_REGIONS", "OPT_IN_REGIONS", "REGIONS", "normalize_regions"]
