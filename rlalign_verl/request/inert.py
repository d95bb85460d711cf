"""Requests that would change nothing are refused, not run as if they acted: regions inert at the rollout's TP size,
a region's setting while the region is off, an experimental setting while alignment is off."""

from __future__ import annotations

from typing import Any

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.base.options import key_name, key_setting, surface
from rlalign_verl.request.regions import BY_NAME, REGISTRY
from rlalign_verl.request.spec import AlignmentSpec, Experimental


def check_inert(spec: AlignmentSpec) -> None:
    """A request that would change nothing is refused, not run as if aligned: regions that are all inert at the
    rollout's TP size (``tp`` at TP 1), or a region's setting (its registry row's ``shows``) changed from its
    default while the region is off."""
    regions = spec.regions
    if spec.rollout_tp == 1 and all(BY_NAME[r].only_tp for r in regions):
        names = ",".join(regions)
        raise AlignmentError(
            f"regions {names} ({key_name('regions')}) change nothing at rollout tensor parallel 1: {names} "
            "mirrors the all-reduce of a rollout at tensor parallel > 1 (verl: actor_rollout_ref.rollout."
            "tensor_model_parallel_size; OpenRLHF: --vllm.tensor_parallel_size; Python: rollout_tp=); add "
            "rope,swiglu,rmsnorm to the regions"
        )
    default = Experimental()
    for row in REGISTRY:
        if row.name in regions or not (row.shows or "").startswith("experimental."):
            continue
        attr = row.shows.split(".", 1)[1]
        value = getattr(spec.experimental, attr)
        if value != getattr(default, attr):
            raise AlignmentError(
                f"{key_setting(row.shows, str(value))} sets what the {row.name} region computes, and {row.name} is "
                f"not in {key_name('regions')}; add {row.name} to the regions or drop the setting"
            )


ACTS_ONLY_ALIGNED = (
    "compile",
    "kernels",
    "attention",
    "head_dtype",
    "compiled_norm",
    "moe_variant",
    "unverified",
)
"""Experimental settings that change only what an aligned region computes (the metrics' own settings and the
version permission act with alignment off too)."""


def check_off(spec: AlignmentSpec) -> None:
    """With alignment off (no regions), a setting that only changes what aligned regions compute would be silently
    inert: refused in one line."""
    default = Experimental()
    changed = [a for a in ACTS_ONLY_ALIGNED if getattr(spec.experimental, a) != getattr(default, a)]
    if changed:
        shown = ", ".join(_setting(a, getattr(spec.experimental, a)) for a in changed)
        raise AlignmentError(
            f"{shown} {'changes' if len(changed) == 1 else 'change'} what aligned regions compute, but {key_name('regions')} is empty (alignment off), so "
            "it would do nothing; drop it, or name the regions to align (e.g. rope,swiglu,rmsnorm)"
        )


def _setting(attr: str, value: Any) -> str:
    """``experimental.<attr>`` set to ``value`` as the current surface writes it."""
    if surface() == "python":
        return f"{attr}={value!r}"
    if isinstance(value, tuple):
        text = f"[{','.join(value)}]" if surface() == "hydra" else ",".join(value)
    else:
        text = str(value).lower() if isinstance(value, bool) else str(value)
    return key_setting(f"experimental.{attr}", text)
