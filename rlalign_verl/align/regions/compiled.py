"""Opt-in ``torch.compile`` variants of the region functions (fused fp32 math, fewer temporaries).

:func:`compiled_regions` returns the region functions of one engine profile compiled with Inductor
(forward and the recomputing backward of their autograd Functions together). Inductor runs with
``emulate_precision_casts=True`` so that every ``R(.)`` of the eager code stays a real rounding to
bf16 (with the default ``False``, Inductor may keep a cast-then-upcast pair in fp32).

Exactness, checked by ``tests/align/test_compiled_regions.py`` against the eager functions on random inputs:

* ``swiglu`` and ``apply_rope``: bit-identical outputs and gradients (elementwise math; the rotation's
  products of two bf16 values are exact in fp32, so FMA contraction cannot change them).
* ``rms_norm`` / ``add_rms_norm``: the mean of squares is a reduction whose order Inductor chooses
  (vectorised partial sums) and ATen chooses differently, so rt can differ in its last fp32 bit and an
  output element occasionally rounds to the neighbouring bf16 value. The roundings are in the same
  places, but the result is not bit-identical; so the norms are compiled only with ``exact=False``
  (default ``True`` returns the eager norms).

``apply_alignment(..., compile=True)`` uses the exact set (``swiglu``, ``apply_rope``) in the patched model.
Norms bit-identical to the *engine's* compiled kernels (not to the eager functions) are
:mod:`.inductor_norm` (``apply_alignment(..., compiled_norm=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlalign_verl.align.regions.rmsnorm import add_rms_norm as _add_rms_norm
from rlalign_verl.align.regions.rmsnorm import rms_norm as _rms_norm
from rlalign_verl.align.regions.rope import apply_rope as _apply_rope
from rlalign_verl.align.regions.swiglu import swiglu as _swiglu
from rlalign_verl.catalog.profiles import EngineProfile, get_profile

INDUCTOR_OPTIONS: dict[str, object] = {"emulate_precision_casts": True}
"""Keep every bf16 rounding of the eager code (see the module docstring)."""


@dataclass(frozen=True)
class CompiledRegions:
    """The region functions of one profile; same signatures as the eager ones minus the rounding."""

    profile: EngineProfile
    swiglu: Callable[..., torch.Tensor]
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    exact: bool


def inductor_available() -> tuple[bool, str]:
    """Whether Inductor can build a kernel here (it needs a C++ compiler on CPU); the reason if not."""
    try:
        fn = torch.compile(
            lambda x: (x.float() * 2).to(torch.bfloat16), dynamic=False, options=INDUCTOR_OPTIONS
        )
        fn(torch.ones(4, dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001 - any backend failure means "not available here"
        return False, f"{type(e).__name__}: {e}".splitlines()[0]
    return True, ""


def compiled_regions(
    engine: str | EngineProfile = "vllm", *, exact: bool = True, dynamic: bool = True
) -> CompiledRegions:
    """Inductor-compiled region functions for ``engine``'s rounding.

    ``exact=True`` (default) compiles only the regions that stay bit-identical to the eager functions
    (``swiglu``, ``apply_rope``) and returns the eager norms; ``exact=False`` compiles the norms too
    (same rounding locations, Inductor's reduction order). ``dynamic=True`` avoids a recompile per
    sequence length.
    """
    profile = get_profile(engine)
    sw_r, rope_r, norm_r = profile.swiglu, profile.rope, profile.norm

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _swiglu(gate, up, sw_r)

    def apply_rope(q, k, cos, sin, *, out_dtype=None, unsqueeze_dim: int = 1):
        return _apply_rope(q, k, cos, sin, rope_r, out_dtype=out_dtype, unsqueeze_dim=unsqueeze_dim)

    def rms_norm(x, weight, eps: float, *, keep_fp32: bool = False):
        return _rms_norm(x, weight, eps, norm_r, keep_fp32=keep_fp32)

    def add_rms_norm(h, residual, weight, eps: float, *, round_residual: bool):
        return _add_rms_norm(h, residual, weight, eps, norm_r, round_residual=round_residual)

    def compile_(fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=dynamic, options=INDUCTOR_OPTIONS)

    return CompiledRegions(
        profile=profile,
        swiglu=compile_(swiglu),
        apply_rope=compile_(apply_rope),
        rms_norm=rms_norm if exact else compile_(rms_norm),
        add_rms_norm=add_rms_norm if exact else compile_(add_rms_norm),
        exact=exact,
    )
