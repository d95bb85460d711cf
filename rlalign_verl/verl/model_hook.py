"""Worker side: patch the actor's and ref's HF model where verl's FSDP engine builds it.

``FSDPEngine._build_module`` (``verl/workers/engine/fsdp/transformer_impl.py``) returns the HF model
after ``from_pretrained``, Liger, verl's ``apply_monkey_patch`` (attention / remove-padding /
Ulysses), the dtype cast and gradient checkpointing, and before LoRA, QAT and FSDP1/FSDP2 wrapping.
Wrapping that one method therefore patches every FSDP build. The per-model switch is the pair of
attributes the driver put on the HF config through ``actor_rollout_ref.model.override_config``;
the critic's config never gets them, so the critic is left alone.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import AlignmentError
from ..wrap_once import wrap_once
from .config import AUTO_KEY, COMPILE_KEY, ENGINE_KEY, KERNELS_KEY, REGIONS_KEY, ROLLOUT_KEY
from .head_dtype import ATTENTION_KEY, COMPILED_NORM_KEY, HEAD_DTYPE_KEY, MOE_VARIANT_KEY, UNVERIFIED_KEY
from .log import logger

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def requested_alignment(module: Any) -> tuple[tuple[str, ...], str] | None:
    """``(regions, profile)`` asked for on ``module.config``; None when nothing is requested."""
    from ..regions import normalize_regions

    cfg = getattr(module, "config", None)
    raw = getattr(cfg, REGIONS_KEY, None)
    if raw is None:
        return None
    if hasattr(raw, "__iter__") and not isinstance(raw, str):
        raw = [str(r) for r in raw]
    regions = normalize_regions(raw)
    if not regions:
        return None
    engine = str(getattr(cfg, ENGINE_KEY, None) or "auto").strip().lower()
    if engine == "auto":
        logger.warning(
            "%s=auto reached the worker (the driver did not resolve it: was validation skipped?); using the "
            "compiled vLLM profile for this worker's device",
            ENGINE_KEY,
        )
    return regions, engine


def _placed_profile(module: Any, engine: str) -> str:
    """The profile checked against where ``module`` runs (:mod:`rlalign_verl.placement`); raises if wrong."""
    from ..placement import check_placement

    cfg = getattr(module, "config", None)
    auto = engine == "auto" or bool(getattr(cfg, AUTO_KEY, False))
    profile = check_placement(
        "vllm" if engine == "auto" else engine, module, auto=auto, rollout=getattr(cfg, ROLLOUT_KEY, None)
    )
    if profile.name != engine:
        logger.info(
            "alignment.engine=auto: profile %s (chosen on the driver) is %s on this worker's device",
            engine,
            profile.name,
        )
    return profile.name


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # pragma: no cover - informational only
        return None


def align_module(module: Any, *, role: str | None = None) -> Any:
    """Apply the alignment requested on ``module.config`` to ``module`` (in place); log one line.

    A requested alignment that cannot be applied raises (the run must not go on silently unaligned).
    """
    wanted = requested_alignment(module)
    if wanted is None:
        return module
    regions, engine = wanted
    name = type(module).__name__
    where = f"role={role or 'unknown'}" + (f", rank {_rank()}" if _rank() is not None else "")
    compile_ = bool(getattr(getattr(module, "config", None), COMPILE_KEY, False))
    kernels = getattr(getattr(module, "config", None), KERNELS_KEY, None)  # None: RLALIGN_TRITON=1 or torch
    opt_in = opt_in_options(getattr(module, "config", None))
    try:
        from ..patch import apply_alignment, get_alignment

        engine = _placed_profile(module, engine)
        apply_alignment(module, regions=regions, engine=engine, compile=compile_, kernels=kernels, **opt_in)
        state = get_alignment(module)
    except Exception as err:
        logger.error(
            "FAILED to align %s (%s) with regions=%s profile=%s: %s", name, where, regions, engine, err
        )
        raise
    if state is None or tuple(state.regions) != tuple(regions):
        msg = f"alignment of {name} ({where}) did not take effect: asked {regions}/{engine}, got {state}"
        logger.error(msg)
        raise AlignmentError(msg)
    logger.info(
        "aligned %s (%s): regions=%s profile=%s%s",
        name,
        where,
        ",".join(state.regions),
        state.profile.name,
        (" (compiled swiglu/rope)" if state.compiled else "")
        + (" (triton swiglu/rope)" if state.kernels == "triton" else ""),
    )
    return module


def opt_in_options(hf_config: Any) -> dict[str, Any]:
    """``apply_alignment`` keywords of the opt-in regions that the driver put on the HF config."""
    out = {}
    if getattr(hf_config, ATTENTION_KEY, None):
        out["attention"] = str(getattr(hf_config, ATTENTION_KEY))
    if getattr(hf_config, HEAD_DTYPE_KEY, None):
        out["head_dtype"] = str(getattr(hf_config, HEAD_DTYPE_KEY))
    raw = getattr(hf_config, UNVERIFIED_KEY, None)
    if raw:
        out["unverified"] = raw if isinstance(raw, str) else [str(v) for v in raw]
    if getattr(hf_config, COMPILED_NORM_KEY, None):
        out["compiled_norm"] = True
    if getattr(hf_config, MOE_VARIANT_KEY, None):
        out["moe_variant"] = str(getattr(hf_config, MOE_VARIANT_KEY))
    return out


def strip_flags(*configs: Any) -> None:
    """Remove our attributes from HF configs once read, so saved checkpoints never carry them."""
    keys = (
        REGIONS_KEY,
        ENGINE_KEY,
        COMPILE_KEY,
        KERNELS_KEY,
        AUTO_KEY,
        ROLLOUT_KEY,
        HEAD_DTYPE_KEY,
        ATTENTION_KEY,
    )
    for cfg in configs:
        for key in (*keys, UNVERIFIED_KEY, COMPILED_NORM_KEY, MOE_VARIANT_KEY):
            if cfg is not None and key in getattr(cfg, "__dict__", {}):
                delattr(cfg, key)


def _role(engine: Any) -> str:
    model_type = getattr(getattr(engine, "model_config", None), "model_type", None)
    if model_type == "value_model":
        return "critic"
    forward_only = bool(getattr(getattr(engine, "engine_config", None), "forward_only", False))
    return "ref" if forward_only else "actor"


def _hook_target_error(where: str) -> AlignmentError:
    return AlignmentError(
        f"verl's {where} is missing (verl version changed?), so rlalign-verl cannot align the actor and ref; "
        f"install verl==0.9.1 (the version this plugin supports) or set alignment.regions=[]"
    )


def check_hook_target() -> None:
    """Raise if verl's FSDP engine no longer has the method the worker hook wraps (driver-side check).

    Reads the module's source instead of importing it: importing verl's engine resolves verl's device
    platform, which must happen in the workers, not on the driver.
    """
    import ast
    import importlib.util
    import os

    spec = importlib.util.find_spec("verl")  # a top-level spec: imports nothing
    root = os.path.dirname(spec.origin) if spec is not None and spec.origin else ""
    path = os.path.join(root, *ENGINE_MODULE.split(".")[1:]) + ".py"
    if not os.path.isfile(path):
        raise _hook_target_error(f"module {ENGINE_MODULE}")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "FSDPEngine":
            if any(isinstance(n, ast.FunctionDef) and n.name == "_build_module" for n in node.body):
                return
    raise _hook_target_error(f"{ENGINE_MODULE}.FSDPEngine._build_module")


def wrap_fsdp_engine(engine_module: ModuleType) -> None:
    """Wrap ``FSDPEngine._build_module`` in verl's FSDP engine module (idempotent).

    A missing target raises: the worker must not go on training unaligned.
    """
    cls = getattr(engine_module, "FSDPEngine", None)
    build = getattr(cls, "_build_module", None)
    if build is None:
        err = _hook_target_error(f"{engine_module.__name__}.FSDPEngine._build_module")
        logger.error("%s", err)
        raise err

    def make(build: Any) -> Any:
        def _build_module(self: Any, *args: Any, **kwargs: Any) -> Any:
            module = build(self, *args, **kwargs)
            try:
                return align_module(module, role=_role(self))
            finally:
                hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
                strip_flags(getattr(module, "config", None), hf_config)

        return _build_module

    wrap_once(cls, "_build_module", make)
