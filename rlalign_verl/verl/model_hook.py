"""Worker side: patch the actor's and ref's HF model where verl's FSDP engine builds it.

``FSDPEngine._build_module`` (``verl/workers/engine/fsdp/transformer_impl.py``) returns the HF model
after ``from_pretrained``, Liger, verl's ``apply_monkey_patch`` (attention / remove-padding /
Ulysses), the dtype cast and gradient checkpointing, and before LoRA, QAT and FSDP1/FSDP2 wrapping.
Wrapping that one method therefore patches every FSDP build. The per-model switch is the one attribute
(:data:`~rlalign_verl.verl.transport.SPEC_KEY`, the resolved spec as JSON) the driver put on the HF config through
``actor_rollout_ref.model.override_config``; the critic's config never gets it, so the critic is left alone.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.base.wrap_once import wrap_once
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.verl.log import logger
from rlalign_verl.verl.transport import OLD_KEYS, SPEC_KEY

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def requested_spec(module: Any) -> AlignmentSpec | None:
    """The spec the driver put on ``module.config``; ``None`` when nothing is requested (e.g. the critic)."""
    cfg = getattr(module, "config", None)
    raw = getattr(cfg, SPEC_KEY, None)
    if raw is None:
        stale = [k for k in OLD_KEYS if getattr(cfg, k, None) not in (None, [], "")]
        if stale:
            logger.warning(
                "%s carries rlalign settings of an older release (%s) and no %s: ignored; the driver writes %s",
                type(module).__name__,
                ", ".join(stale),
                SPEC_KEY,
                SPEC_KEY,
            )
        return None
    spec = AlignmentSpec.from_json(raw if isinstance(raw, str) else dict(raw))
    if spec.regions and spec.engine == "auto":
        logger.warning(
            "%s=auto reached the worker (the driver did not resolve it: was validation skipped?); the compiled vLLM "
            "profile for this worker's device is used",
            SPEC_KEY,
        )
    return spec if spec.regions else None


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # pragma: no cover - informational only
        return None


def align_module(module: Any, *, role: str | None = None) -> Any:
    """Apply the alignment requested on ``module.config`` to ``module`` (in place); log one line.

    The spec is checked where the model lives (its device: an ``auto`` profile moves to this device's build);
    a requested alignment that cannot be applied raises (the run must not go on silently unaligned).
    """
    spec = requested_spec(module)
    if spec is None:
        return module
    name = type(module).__name__
    where = f"role={role or 'unknown'}" + (f", rank {_rank()}" if _rank() is not None else "")
    try:
        from rlalign_verl.align.patch import align_on_worker
        from rlalign_verl.catalog.placement import worker_device_type

        # the one check on the worker: the driver's request against the model and this worker's device
        state = align_on_worker(module, spec, device=worker_device_type(module), spelling="hydra")
        if state is not None and state.profile.name != spec.engine:
            logger.info(
                "alignment.engine=auto: profile %s (chosen on the driver) is %s on this worker's device",
                spec.engine,
                state.profile.name,
            )
    except Exception as err:
        logger.error("FAILED to align %s (%s) with %s: %s", name, where, spec.describe(), err)
        raise
    if state is None or tuple(state.regions) != tuple(spec.regions):
        msg = f"alignment of {name} ({where}) did not take effect: asked {spec.describe()}, got {state}"
        logger.error(msg)
        raise AlignmentError(msg)
    logger.info(
        "aligned %s (%s): regions=%s profile=%s%s",
        name,
        where,
        ",".join(state.regions),
        state.profile.name,
        (f" rollout_tp={state.spec.rollout_tp}" if state.spec.rollout_tp > 1 else "")
        + (" (compiled swiglu/rope)" if state.compiled else "")
        + (" (triton swiglu/rope)" if state.kernels == "triton" else ""),
    )
    return module


def strip_flags(*configs: Any) -> None:
    """Remove our attributes from HF configs once read, so saved checkpoints never carry them."""
    for cfg in configs:
        for key in (SPEC_KEY, *OLD_KEYS):
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
