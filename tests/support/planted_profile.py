"""A planted wrong profile for the in-run verification tests (test code, not shipped).

``planted-worse``: ``vllm-cpu`` whose SwiGLU output is rounded to 4 significant bits, a rounding point no
engine has, so the aligned trainer is measurably *farther* from the vLLM CPU engine than the unaligned one.
Loaded into every verl process (driver, TaskRunner, workers) with ``VERL_USE_EXTERNAL_MODULES=planted_profile``
and ``tests/support`` on ``PYTHONPATH``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlalign_verl.align import forwards
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.catalog.profiles import PROFILES, VLLM_CPU, SwigluRounding

NAME = "planted-worse"


@dataclass(frozen=True)
class CoarseSwiglu(SwigluRounding):
    """``R(silu(g) * u)`` then rounded again to 4 significant bits."""


def _coarse(x: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.round(mantissa * 16) / 16, exponent).to(x.dtype)


def _swiglu(gate, up, rounding, **kwargs):
    if isinstance(rounding, CoarseSwiglu):
        return _coarse(swiglu(gate, up, SwigluRounding(roundings=1), **kwargs))
    return swiglu(gate, up, rounding, **kwargs)


if NAME not in PROFILES:
    PROFILES[NAME] = VLLM_CPU.with_name(NAME, swiglu=CoarseSwiglu(roundings=1), verified_on=())
    forwards.swiglu = _swiglu  # the name the aligned MLP forward calls
