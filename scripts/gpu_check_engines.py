"""The engine side of ``scripts/gpu_profile_check.py``: each CUDA profile's ops as an :class:`Engine`.

* ``vllm-eager``: vLLM's CUDA kernels (``torch.ops._C`` of an installed vLLM, or the bundle's built
  ``torch.ops.rlalign_gpu``), allocated as vLLM's Python wrappers allocate them;
* ``vllm``: vLLM's native ops compiled by Inductor with a dynamic token dimension (an installed vLLM's, or
  the bundle's sources with vLLM's compile settings for the device);
* ``sglang``: ``sgl_kernel``'s ops, or the bundle's FlashInfer kernels as sgl-kernel calls them (no SwiGLU).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)


@dataclasses.dataclass
class Engine:
    """The engine-side implementation of each region for one profile."""

    profile: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None  # None: not available (no swiglu rows)
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (positions, q, k, head_size, cache)
    cache_dtype: torch.dtype
    piece: Callable[..., tuple[torch.Tensor, ...]] | None = None
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def _vllm_eager_engine(ops: Any = None) -> Engine:
    """vLLM's CUDA kernels: ``torch.ops._C`` of the installed vLLM, or ``ops`` (the bundle's built kernels), called
    as vLLM's Python wrappers call them (:func:`gpu_bundle_natives.eager_ops_functions`)."""
    fns = importlib.import_module("gpu_bundle_natives").eager_ops_functions(
        torch.ops._C if ops is None else ops
    )
    rms, rope = fns["rms"], fns["rope"]

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = rms(q.view(t, -1, head_size).contiguous(), wq, eps).view(t, -1)
        kn = rms(k.view(t, -1, head_size).contiguous(), wk, eps).view(t, -1)
        return rope(pos, qn, kn, head_size, cache)

    return Engine("vllm-eager", rms, fns["add_rms"], fns["silu"], rope, torch.bfloat16, qk_norm_rope=qk_rope)


def _mark_tokens_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


def _vllm_compiled_engine(natives: dict[str, Callable] | None = None, options: dict | None = None) -> Engine:
    """vLLM's native ops compiled by Inductor: the installed vLLM's, or ``natives`` (the bundle's sources,
    ``rms``/``add_rms``/``silu``/``rope``) compiled with ``options`` (vLLM's settings for the device)."""
    if natives is None:
        from vllm import ir
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        def _static_rope(pos, q, k, head_size, cache):
            return RotaryEmbedding.forward_static(pos, q, k, head_size, head_size, cache, True)

        natives = {
            "rms": ir.ops.rms_norm.impls["native"].impl_fn,
            "add_rms": ir.ops.fused_add_rms_norm.impls["native"].impl_fn,
            "silu": SiluAndMul.forward_native,
            "rope": _static_rope,
        }
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    native_rms, native_add_rms, native_silu, native_rope = (
        natives[k] for k in ("rms", "add_rms", "silu", "rope")
    )

    def _rms(x, w, eps):
        return native_rms(x, w, eps)

    def _add_rms(h, r, w, eps):
        return native_add_rms(h, r, w, eps)

    def _silu(gu):
        return native_silu(gu)

    def _rope(pos, q, k, head_size, cache):
        return native_rope(pos, q, k, head_size, cache)

    def _piece(h1, r0, w1, h2, w2, eps):
        # post-attention norm -> (MLP, here an independent h2) -> next input norm; the residual between
        # the two norms is not an output of the piece, as in vLLM's graph split at attention.
        y1, r1 = native_add_rms(h1, r0, w1, eps)
        y2, r2 = native_add_rms(h2, r1, w2, eps)
        return y1, y2, r2

    def _qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = native_rms(q.view(t, -1, head_size), wq, eps).view(t, -1)
        kn = native_rms(k.view(t, -1, head_size), wk, eps).view(t, -1)
        return native_rope(pos, qn, kn, head_size, cache)

    compiled = {
        name: torch.compile(fn, backend="inductor", options=options)
        for name, fn in (
            ("rms", _rms),
            ("add", _add_rms),
            ("silu", _silu),
            ("rope", _rope),
            ("piece", _piece),
            ("qk", _qk_rope),
        )
    }

    def rms(x, w, eps):
        _mark_tokens_dynamic(x)
        return compiled["rms"](x, w, eps)

    def add_rms(h, r, w, eps):
        _mark_tokens_dynamic(h, r)
        return compiled["add"](h, r, w, eps)

    def silu(gu):
        _mark_tokens_dynamic(gu)
        return compiled["silu"](gu)

    def rope(pos, q, k, head_size, cache):
        _mark_tokens_dynamic(pos, q, k)
        return compiled["rope"](pos, q, k, head_size, cache)

    def piece(h1, r0, w1, h2, w2, eps):
        _mark_tokens_dynamic(h1, r0, h2)
        return compiled["piece"](h1, r0, w1, h2, w2, eps)

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        _mark_tokens_dynamic(pos, q, k)
        return compiled["qk"](pos, q, k, wq, wk, head_size, cache, eps)

    return Engine("vllm", rms, add_rms, silu, rope, torch.bfloat16, piece=piece, qk_norm_rope=qk_rope)


def _sglang_engine(fns: dict[str, Any] | None = None) -> Engine:
    """``sgl_kernel``'s ops, or ``fns`` (the bundle's FlashInfer kernels as sgl-kernel calls them; no swiglu)."""
    if fns is not None:
        rms_, rope_ = fns["rms"], fns["rope"]

        def qk(pos, q, k, wq, wk, head_size, cache, eps):
            t = q.shape[0]
            qn = rms_(q.reshape(-1, head_size), wq, eps).view(t, -1)
            kn = rms_(k.reshape(-1, head_size), wk, eps).view(t, -1)
            return rope_(pos, qn, kn, head_size, cache)

        return Engine("sglang", rms_, fns["add_rms"], fns["silu"], rope_, torch.float32, qk_norm_rope=qk)
    import sgl_kernel

    def rms(x, w, eps):
        return sgl_kernel.rmsnorm(x.contiguous(), w, eps)

    def add_rms(h, r, w, eps):
        h2, r2 = h.clone(), r.clone()
        sgl_kernel.fused_add_rmsnorm(h2, r2, w, eps)
        return h2, r2

    def silu(gu):
        return sgl_kernel.silu_and_mul(gu)

    def rope(pos, q, k, head_size, cache):
        q2, k2 = q.clone(), k.clone()
        sgl_kernel.apply_rope_with_cos_sin_cache_inplace(
            positions=pos, query=q2, key=k2, head_size=head_size, cos_sin_cache=cache, is_neox=True
        )
        return q2, k2

    def qk_rope(pos, q, k, wq, wk, head_size, cache, eps):
        t = q.shape[0]
        qn = rms(q.reshape(-1, head_size), wq, eps).view(t, -1)
        kn = rms(k.reshape(-1, head_size), wk, eps).view(t, -1)
        return rope(pos, qn, kn, head_size, cache)

    return Engine("sglang", rms, add_rms, silu, rope, torch.float32, qk_norm_rope=qk_rope)


def make_engines(profiles: list[str], bundle: Any = None) -> tuple[dict[str, Engine], dict[str, str]]:
    """The engines for ``profiles`` (the installed engines', or ``bundle``'s: a ``BundleOps``); profiles that
    cannot run here come back in the second dict."""
    if bundle is not None:
        return _bundle_engines(profiles, bundle)
    engines: dict[str, Engine] = {}
    unavailable: dict[str, str] = {}
    builders = {"vllm-eager": _vllm_eager_engine, "vllm": _vllm_compiled_engine, "sglang": _sglang_engine}
    for name in profiles:
        if name == "sglang" and importlib.util.find_spec("sgl_kernel") is None:
            unavailable[name] = "sgl_kernel is not installed"
            continue
        try:
            engines[name] = builders[name]()
        except Exception as exc:
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    return engines, unavailable


def _bundle_engines(profiles: list[str], bundle: Any) -> tuple[dict[str, Engine], dict[str, str]]:
    """:func:`make_engines` with the bundle's ops (``--bundle``)."""
    natives = importlib.import_module("gpu_bundle_natives")
    engines: dict[str, Engine] = {}
    unavailable: dict[str, str] = {}
    for name in profiles:
        try:
            if name == "vllm":
                fns = natives.natives_functions(bundle.natives)
                engines[name] = _vllm_compiled_engine(fns, bundle.options())
            elif name == "vllm-eager" and bundle.ops is not None:
                engines[name] = _vllm_eager_engine(bundle.ops)
            elif name == "sglang" and bundle.fi is not None:
                engines[name] = _sglang_engine(natives.flashinfer_functions(bundle.fi))
                unavailable["sglang swiglu"] = bundle.notes.get("sglang swiglu", "not bundled")
            else:
                unavailable[name] = bundle.notes.get(name, "not in the bundle")
        except Exception as exc:
            unavailable[name] = f"{type(exc).__name__}: {exc}"
    return engines, unavailable
