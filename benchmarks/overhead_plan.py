"""Which model-level settings a run measures: the model sizes and the (size, dtype, layout, mode) matrix."""

from __future__ import annotations

from dataclasses import dataclass

from overhead_model import MODES, Size, Variant, variants_for

QUICK_SIZES = [Size("h256-L2", 256, 704, 2, 4, 2, seq=128, batch=2, vocab=1024)]
FULL_SIZES = [
    Size("h512-L4", 512, 1408, 4, 8, 2, seq=256, batch=2),
    Size("h1024-L4", 1024, 2816, 4, 16, 4, seq=128, batch=2),
]
GPU_SIZES = [
    Size("h1024-L8", 1024, 2816, 8, 16, 4, seq=1024, batch=4),
    Size("h2048-L8", 2048, 5632, 8, 16, 4, seq=2048, batch=2),
]
"""Too slow for a 2-core CPU in 5 minutes; select them with ``--sizes`` on a GPU."""
SIZES = {s.name: s for s in QUICK_SIZES + FULL_SIZES + GPU_SIZES}


@dataclass(frozen=True)
class Setting:
    """One (size, dtype, layout, mode) and the variants compared in it."""

    size: Size
    dtype: str
    layout: str
    mode: str
    variants: tuple[Variant, ...]


def plan(quick: bool, profiles: list[str], sizes: list[Size] | None = None) -> list[Setting]:
    """Which settings to run: bf16 padded on the first size gets each region alone for the first two
    profiles; the other settings compare ``hf`` with all regions of every profile."""
    every = tuple(variants_for(profiles, per_region=profiles[: 1 if quick else 2]))
    main = tuple(variants_for(profiles, per_region=[]))
    out: list[Setting] = []
    if quick:
        size = QUICK_SIZES[0]
        out += [Setting(size, "bf16", "padded", mode, every) for mode in MODES]
        out.append(Setting(size, "bf16", "packed", "train", main))
        out.append(Setting(size, "fp32+autocast", "padded", "train", main))
        return out
    first, *rest = sizes or FULL_SIZES
    for mode in MODES:
        out.append(Setting(first, "bf16", "padded", mode, every))
    for mode in MODES:
        out.append(Setting(first, "bf16", "packed", mode, main))
        if mode != "train-gc":  # keeps the full run under 5 minutes on 2 shared cores
            out.append(Setting(first, "fp32+autocast", "padded", mode, main))
    for size in rest:
        for mode in ("train", "train-gc", "logprob"):
            out.append(Setting(size, "bf16", "padded", mode, main))
    return out
