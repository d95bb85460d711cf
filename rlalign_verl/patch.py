"""The generic patcher: ``apply_alignment`` / ``remove_alignment`` / ``aligned``.

One set of aligned forwards (decoder layer, attention, MLP, final norm) serves every family in
:mod:`rlalign_verl.families`; the profile decides the rounding. Patching binds a forward on each
*instance* (``module.forward``), so the classes, ``state_dict`` keys, parameter dtypes and other models in
the same process are untouched, and removal restores the instances exactly. The class form
(``model=None``) hooks the families' base-model constructors so that models built afterwards are
patched the same way.
"""

from __future__ import annotations

import contextlib
import logging
import types
import weakref
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from .errors import AlignmentError, LigerConflictError, UnsupportedModelError
from .families import FAMILIES, ModelFamily, get_family
from .forwards import (
    AlignmentState,
    attention_forward,
    base_model_forward,
    final_norm_forward,
    layer_forward,
    mlp_forward,
    region_fns,
)
from .guard import SAVED_FORWARD, check_intact, check_model_arg
from .kernels import resolve_kernels
from .moe_patch import bind_moe, check_moe_config
from .moe_variant import check_moe_variant, check_moe_variant_model, parse_moe_variant
from .options import parse_bool
from .placement import vllm_cpu_kernel_store
from .profiles import DEFAULT_PROFILE, EngineProfile, get_profile
from .regions import normalize_regions
from .regions.attention import check_attention_supported
from .regions.inductor_norm import check_compiled_norm, check_compiled_norm_model
from .regions.lm_head import head_forward, parse_head_dtype
from .regions.residual_stream import Carry, carry_for
from .unverified import resolve_unverified

logger = logging.getLogger("rlalign_verl")

_STATE_ATTR = "_rlalign_state"
_SAVED_FORWARD = SAVED_FORWARD


# --- instance patching -------------------------------------------------------------------------


def _bind(module: nn.Module, fn: Callable) -> None:
    if _SAVED_FORWARD not in module.__dict__:
        module.__dict__[_SAVED_FORWARD] = module.__dict__.get("forward")
    module.forward = types.MethodType(fn, module)


def _unbind(module: nn.Module) -> None:
    if _SAVED_FORWARD not in module.__dict__:
        return
    saved = module.__dict__.pop(_SAVED_FORWARD)
    if saved is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


def _is_liger(obj: object) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.startswith("liger_kernel")


def _check_not_liger(model: nn.Module, family: ModelFamily) -> None:
    offenders = []
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        if (
            _is_liger(type(m))
            or _is_liger(type(m).forward)
            or (fwd is not None and _is_liger(getattr(fwd, "__func__", fwd)))
        ):
            offenders.append(name or type(m).__name__)
    rope_fn = getattr(family.module(), "apply_rotary_pos_emb", None)
    if _is_liger(rope_fn):
        offenders.append(f"{family.modeling_module}.apply_rotary_pos_emb")
    if offenders:
        raise LigerConflictError(
            "this model was patched by Liger kernels ("
            + ", ".join(offenders[:3])
            + (" ..." if len(offenders) > 3 else "")
            + "), which replace the same RoPE/RMSNorm/SwiGLU forwards with their own rounding; build the model "
            "without Liger (verl: actor_rollout_ref.model.use_liger=False; OpenRLHF: drop --use_liger_kernel) "
            "or turn alignment off"
        )


def _base_model(model: nn.Module, family: ModelFamily) -> nn.Module:
    base_cls = family.cls("base_model")
    if isinstance(model, base_cls):
        return model
    for m in model.modules():
        if isinstance(m, base_cls):
            return m
    raise UnsupportedModelError(f"no {family.base_model} found inside {type(model).__name__}")


def _patch_instance(
    model: nn.Module,
    regions: tuple[str, ...],
    profile: EngineProfile,
    compiled: bool = False,
    kernels: str = "torch",
    **options: str,
) -> nn.Module:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no HF config.model_type; apply_alignment needs a transformers model "
            f"of type {', '.join(FAMILIES)}"
        )
    family = get_family(model_type)
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act={act!r}: the swiglu region supports silu only")
    _check_not_liger(model, family)
    check_moe_config(config, family, profile, regions, options.get("unverified", ()))
    check_compiled_norm_model(model_type, bool(options.get("compiled_norm")))
    check_moe_variant_model(model_type, str(options.get("moe_variant", "emulate")))

    current = _state(model)
    if current is not None:
        if current == AlignmentState(regions, profile, model_type, compiled, kernels, **options):
            return model  # idempotent
        _unpatch_instance(model)
    if not regions:
        return model

    st = AlignmentState(regions, profile, model_type, compiled, kernels, **options)
    base = _base_model(model, family)
    layer_cls, attn_cls, mlp_cls = family.cls("decoder_layer"), family.cls("attention"), family.cls("mlp")
    attn_needed = "rope" in regions or "attention" in regions or ("rmsnorm" in regions and family.qk_norm)
    swiglu_fn, rope_fn = region_fns(st)
    attn_fwd = attention_forward(st, family, base.rotary_emb, rope_fn) if attn_needed else None
    mlp_fwd = mlp_forward(swiglu_fn) if "swiglu" in regions else None
    layer_fwd = layer_forward(st) if "rmsnorm" in regions else None
    for m in model.modules():
        if attn_fwd and isinstance(m, attn_cls):
            _bind(m, attn_fwd)
        elif mlp_fwd and isinstance(m, mlp_cls):
            _bind(m, mlp_fwd)
        elif layer_fwd and isinstance(m, layer_cls):
            _bind(m, layer_fwd)
    bind_moe(model, family, profile, regions, _bind, st.moe_variant)
    if layer_fwd:
        _bind(base.norm, final_norm_forward(st))
        if carry_for(profile) is not Carry.ROUNDED_SUM:  # s - R(s) travels in a per-forward carry
            _bind(base, base_model_forward(_SAVED_FORWARD))
    if (
        "lm_head" in regions and st.head_dtype == "float32"
    ):  # head_dtype "model": HF's bf16 head is the engine's
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            raise UnsupportedModelError(
                f"the lm_head region needs the *ForCausalLM model, not {type(model).__name__}"
            )
        _bind(head, head_forward(cuda_path=profile.device == "cuda"))
    model.__dict__[_STATE_ATTR] = st
    if base is not model:
        base.__dict__[_STATE_ATTR] = st
    return model


def _unpatch_instance(model: nn.Module) -> None:
    for m in model.modules():
        _unbind(m)
        m.__dict__.pop(_STATE_ATTR, None)


# --- class form: patch models as they are constructed -----------------------------------------

_class_patch: dict[str, object] = {}
_patched_models: weakref.WeakSet = weakref.WeakSet()


def _install_class_hooks(
    regions: tuple[str, ...],
    profile: EngineProfile,
    compiled: bool,
    kernels: str,
    unverified: tuple[str, ...],
    **options: str | bool,
) -> None:
    _remove_class_hooks()
    for family in FAMILIES.values():
        try:
            base_cls = family.cls("base_model")
        except (ImportError, AttributeError):
            continue
        original_init = base_cls.__init__

        def init(self, *args, _orig=original_init, **kwargs):
            _orig(self, *args, **kwargs)
            _patch_instance(self, regions, profile, compiled, kernels, unverified=unverified, **options)
            _patched_models.add(self)

        init.__wrapped__ = original_init  # type: ignore[attr-defined]
        base_cls.__init__ = init
        _class_patch[family.model_type] = (base_cls, original_init)
    _class_patch["state"] = (regions, profile)


def _remove_class_hooks() -> None:
    for key, value in list(_class_patch.items()):
        if key != "state":
            base_cls, original_init = value
            base_cls.__init__ = original_init
    _class_patch.clear()


# --- public API --------------------------------------------------------------------------------


def get_alignment(model: nn.Module) -> AlignmentState | None:
    """The alignment active on ``model`` (a HF model or its base model), or ``None``.

    Raises ``AlignmentOverriddenError`` when the aligned forwards were replaced afterwards (e.g. by Liger).
    """
    st = _state(model)
    if st is not None:
        family = get_family(st.model_type)
        wanted = {"swiglu": "mlp", "rmsnorm": "decoder_layer", "rope": "attention", "attention": "attention"}
        check_intact(model, st.describe(), [family.cls(wanted[r]) for r in st.regions if r in wanted])
    return st


def _state(model: nn.Module) -> AlignmentState | None:
    st = model.__dict__.get(_STATE_ATTR)
    if st is None:
        for m in model.modules():
            st = m.__dict__.get(_STATE_ATTR)
            if st is not None:
                break
    return st


def apply_alignment(
    model: nn.Module | None = None,
    *,
    regions: Iterable[str] | str | None = ("rope", "swiglu", "rmsnorm"),
    engine: str | EngineProfile = DEFAULT_PROFILE,
    compile: bool = False,
    kernels: str | None = None,
    attention: str = "engine-op",
    head_dtype: str | None = "float32",
    compiled_norm: bool = False,
    unverified: Iterable[str] | str | None = None,
    moe_variant: str = "emulate",
) -> nn.Module | None:
    """Align ``model`` (in place, before FSDP/DeepSpeed wrapping) to ``engine``'s rounding in ``regions``.

    With ``model=None`` every supported model constructed afterwards is aligned (class form).
    ``compile=True`` runs SwiGLU and RoPE as Inductor-compiled functions (same bits, faster; needs a
    working Inductor backend, i.e. a C++ compiler on CPU or Triton on GPU). ``kernels``: ``"torch"``
    (default; PyTorch fp32 ops) or ``"triton"`` (opt-in fused forwards on CUDA; ``None`` reads
    ``RLALIGN_TRITON=1``); not combinable with ``compile=True``.
    Opt-in regions: ``attention`` (``attention="engine-op"`` or ``"sdpa-fp32"``; vLLM CPU profiles only) and
    ``lm_head`` (``head_dtype``: the engine's head dtype, ``"float32"`` or ``"model"``; instance form only).
    ``compiled_norm=True`` (opt-in; profiles with ``norm_inductor`` options, i.e. ``vllm-cpu``) runs the norm
    forwards through Inductor with the engine's options and kernel shapes: bit-exact with the engine's kernels.
    ``unverified``: profile data not yet checked against the engine that you opt into (``("moe",)``: the CUDA
    profiles' MoE rounding, needed to align swiglu/moe of an MoE model with them); ``RLALIGN_UNVERIFIED=moe``
    is an equivalent spelling, added to this. ``moe_variant``: MoE experts + combine ``"emulate"`` (default,
    PyTorch math) or ``"engine-op"`` (opt-in; vllm-cpu profiles with swiglu and moe aligned on an MoE model:
    vLLM CPU's own ``cpu_fused_moe`` in forward, the emulated path's gradients; needs vLLM in the process).
    Idempotent; ``regions=()`` changes nothing. Raises ``UnknownRegionError``, ``UnknownProfileError``,
    ``UnsupportedModelError`` or ``LigerConflictError`` with a message naming the fix.
    """
    check_model_arg(model)
    compile = parse_bool(compile, name="compile")
    regions_t = normalize_regions(regions)
    profile = get_profile(engine)
    if "rope" in regions_t and profile.rope.store == "vllm-cpu-kernel":
        vllm_cpu_kernel_store()  # a host whose kernel rounding is not established is refused before patching
    kernels_ = resolve_kernels(kernels, compile=compile)
    compiled_norm = parse_bool(compiled_norm, name="compiled_norm")
    check_compiled_norm(profile, regions_t, compiled_norm)
    options = {
        "attention_variant": attention,
        "head_dtype": parse_head_dtype(head_dtype),
        "compiled_norm": compiled_norm,
        "unverified": resolve_unverified(unverified),
        "moe_variant": check_moe_variant(profile, regions_t, moe_variant)
        if regions_t
        else parse_moe_variant(moe_variant),
    }
    if "attention" in regions_t:
        check_attention_supported(profile, attention)
    if model is None:
        if "lm_head" in regions_t:
            raise AlignmentError(
                "the lm_head region needs a model: call apply_alignment(model, ...) on the built model"
            )
        if regions_t:
            opts = {
                k: options[k] for k in ("attention_variant", "compiled_norm", "moe_variant")
            }  # lm_head: refused
            _install_class_hooks(regions_t, profile, compile, kernels_, options["unverified"], **opts)
        else:
            _remove_class_hooks()
        return None
    if not regions_t:
        if _state(model) is not None:
            _unpatch_instance(model)
        return model
    _patch_instance(model, regions_t, profile, compile, kernels_, **options)
    logger.debug("rlalign: aligned %s: %s", type(model).__name__, _state(model).describe())
    return model


def remove_alignment(model: nn.Module | None = None) -> None:
    """Undo :func:`apply_alignment`: on ``model``, or (``None``) the class form and every model it patched."""
    if model is not None:
        _unpatch_instance(model)
        return
    _remove_class_hooks()
    for m in list(_patched_models):
        _unpatch_instance(m)
    _patched_models.clear()


@contextlib.contextmanager
def aligned(
    model: nn.Module | None = None,
    *,
    regions: Iterable[str] | str | None = ("rope", "swiglu", "rmsnorm"),
    engine: str | EngineProfile = DEFAULT_PROFILE,
    compile: bool = False,
    kernels: str | None = None,
    attention: str = "engine-op",
    head_dtype: str | None = "float32",
    compiled_norm: bool = False,
    unverified: Iterable[str] | str | None = None,
    moe_variant: str = "emulate",
) -> Iterator[nn.Module | None]:
    """Context-manager form: aligned inside the block, restored on exit."""
    previous = _state(model) if model is not None else None
    apply_alignment(
        model,
        regions=regions,
        engine=engine,
        compile=compile,
        kernels=kernels,
        attention=attention,
        head_dtype=head_dtype,
        compiled_norm=compiled_norm,
        unverified=unverified,
        moe_variant=moe_variant,
    )
    try:
        yield model
    finally:
        remove_alignment(model)
        if previous is not None:
            apply_alignment(
                model,
                regions=previous.regions,
                engine=previous.profile,
                compile=previous.compiled,
                kernels=previous.kernels,
                attention=previous.attention_variant,
                head_dtype=previous.head_dtype,
                compiled_norm=previous.compiled_norm,
                unverified=previous.unverified,
                moe_variant=previous.moe_variant,
            )
