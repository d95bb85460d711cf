"""The engines' ops for the GPU check, taken from the bundle (``scripts/gpu_bundle.py``) instead of an install.

The GPU machine has no vLLM, SGLang or FlashInfer. From the bundle this module gives the check:

* :func:`load_natives`: vLLM's native op implementations (what its default compiled path traces into the
  model graph) read from the bundled Python files. Those files import vLLM at module level, so they are
  not imported: each function is taken out of its file by name (decorators dropped, body verbatim) and
  executed in a namespace holding only ``torch``, ``F``, ``Tensor`` and ``ApplyRotaryEmb`` (the only
  globals the functions use; a function needing anything else is refused by name);
* :func:`inductor_options`: vLLM's Inductor settings on the device (CUDA: ``CompilationConfig`` and
  ``InductorAdaptor``; CPU: the CPU platform's), each anchored to a line of the bundled sources
  (:func:`check_anchors`);
* :func:`prepare`: all of it together, with (on CUDA) the kernels built by ``gpu_bundle_build.py``, as a
  :class:`BundleOps`; and the engines' calling conventions on the built kernels
  (:func:`eager_ops_functions`, :func:`flashinfer_functions`, :func:`topk_softmax`).
"""

from __future__ import annotations
import __future__

import ast
import builtins
import dis
import importlib
import importlib.util
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)


build = importlib.import_module("gpu_bundle_build")
BundleError = build.BundleError

# --- vLLM's compile settings -----------------------------------------------------------------------------

CUDA_INDUCTOR_OPTIONS: dict[str, Any] = {
    # CompilationConfig.__post_init__ (vllm/config/compilation.py)
    "enable_auto_functionalized_v2": False,
    "size_asserts": False,  # torch < 2.12 (the device has 2.11) and VLLM_LOGGING_LEVEL != DEBUG
    "alignment_asserts": False,
    "scalar_asserts": False,
    "combo_kernels": True,  # torch >= 2.9 and not the CPU platform
    "benchmark_combo_kernel": True,
    # InductorAdaptor.compile (vllm/compilation/compiler_interface.py); max_autotune and
    # coordinate_descent_tuning are set there only for single-size compile ranges, not the dynamic one
    "fx_graph_cache": True,
    "fx_graph_remote_cache": False,
}
ASSERT_KEYS = ("size_asserts", "alignment_asserts", "scalar_asserts")
ANCHORS: dict[str, tuple[str, ...]] = {
    # each setting above (and the choice of the native ops under Inductor) is a line of the bundled sources
    "vllm/config/compilation.py": (
        'KEY = "enable_auto_functionalized_v2"',
        "self.inductor_compile_config[KEY] = False",
        'if not is_torch_equal_or_newer("2.12.0.dev"):',
        '"size_asserts",',
        '"alignment_asserts",',
        '"scalar_asserts",',
        'self.inductor_compile_config["combo_kernels"] = True',
        'self.inductor_compile_config["benchmark_combo_kernel"] = True',
    ),
    "vllm/compilation/compiler_interface.py": (
        'current_config["fx_graph_cache"] = True',
        'current_config["fx_graph_remote_cache"] = False',
    ),
    "vllm/platforms/cuda.py": ('default = ["native"] if using_inductor else ["vllm_c", "native"]',),
}


def inductor_options(device: str, torch_version: str = torch.__version__) -> dict[str, Any]:
    """The Inductor options vLLM compiles its graph pieces with on ``device`` under ``torch_version``."""
    if device != "cuda":
        from rlalign_verl.tools.diagnose.engine_compile import CPU_INDUCTOR_OPTIONS

        return dict(CPU_INDUCTOR_OPTIONS)
    from packaging.version import Version

    opts = dict(CUDA_INDUCTOR_OPTIONS)
    if Version(torch_version) >= Version("2.12.0.dev"):  # vLLM leaves the asserts to torch from 2.12 on
        for key in ASSERT_KEYS:
            del opts[key]
    return opts


def check_anchors(bundle: Any) -> list[str]:
    """The anchor lines of :data:`ANCHORS` missing from the bundled sources (empty: the settings hold)."""
    out = []
    for rel, needles in ANCHORS.items():
        text = (bundle.vllm_root / rel).read_text()
        out += [f"{rel}: {n!r} not found" for n in needles if n not in text]
    return out


# --- vLLM's native ops, from the bundled Python files ----------------------------------------------------

NATIVE_SOURCES = {
    # name here: (file in the sdist, qualified name in that file)
    "rms_norm": ("vllm/ir/ops/layernorm.py", "rms_norm"),
    "fused_add_rms_norm": ("vllm/ir/ops/layernorm.py", "fused_add_rms_norm"),
    "silu_and_mul": ("vllm/model_executor/layers/activation.py", "SiluAndMul.forward_native"),
    "apply_rotary_emb": ("vllm/model_executor/layers/rotary_embedding/common.py", "ApplyRotaryEmb.forward_static"),
    "rotary_forward_static": ("vllm/model_executor/layers/rotary_embedding/base.py", "RotaryEmbedding.forward_static"),
    "compute_inv_freq": ("vllm/model_executor/layers/rotary_embedding/base.py", "RotaryEmbeddingBase._compute_inv_freq"),
    "compute_cos_sin_cache": (
        "vllm/model_executor/layers/rotary_embedding/base.py", "RotaryEmbeddingBase._compute_cos_sin_cache"
    ),
}  # fmt: skip


def function_source(path: Path, qualname: str) -> tuple[str, int]:
    """The source of ``qualname``'s ``def`` (decorators excluded), dedented, and its first line number."""
    src = path.read_text()
    node: Any = ast.parse(src)
    for part in qualname.split("."):
        node = next(
            (n for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part), None
        )
        if node is None:
            raise BundleError(f"{path}: no {qualname} (another vLLM version?)")
    lines = src.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    return textwrap.dedent("".join(lines)), node.lineno


def _globals_of(code: types.CodeType) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_of(const)
    return names


def load_natives(bundle: Any) -> types.SimpleNamespace:
    """vLLM's native ops, executed from the bundled files without importing vLLM (see the module docstring).

    Attributes: ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul`` (``SiluAndMul.forward_native``),
    ``apply_rotary_emb``, ``rotary_forward_static``, ``cos_sin_cache(rotary_dim, max_position, base)``
    (``RotaryEmbeddingBase._compute_cos_sin_cache``: fp32, on the current default device) and ``sources``
    (``{name: "file:line"}``).
    """
    apply_ns = types.SimpleNamespace()  # what rotary_forward_static calls as ApplyRotaryEmb.forward_static
    env: dict[str, Any] = {
        "__builtins__": builtins,
        "torch": torch,
        "F": torch.nn.functional,
        "Tensor": torch.Tensor,
        "ApplyRotaryEmb": apply_ns,
    }
    allowed = set(env) | set(dir(builtins))
    fns: dict[str, Any] = {}
    where = {}
    for name, (rel, qualname) in NATIVE_SOURCES.items():
        path = bundle.vllm_root / rel
        text, line = function_source(path, qualname)
        flags = __future__.annotations.compiler_flag  # annotations stay strings: vLLM's types are not here
        code = compile("\n" * (line - 1) + text, str(path), "exec", flags, True)
        ns: dict[str, Any] = {}
        exec(code, env, ns)  # defines the one function (a def statement, nothing else runs)
        fn = ns[qualname.rsplit(".", 1)[-1]]
        unknown = sorted(_globals_of(fn.__code__) - allowed)
        if unknown:
            raise BundleError(f"{rel}:{line} {qualname} needs {unknown}, which the standalone loader lacks")
        fns[name] = fn
        where[name] = f"{rel}:{line}"
    apply_ns.forward_static = fns["apply_rotary_emb"]

    def cos_sin_cache(rotary_dim: int, max_position: int, base: float) -> torch.Tensor:
        owner = types.SimpleNamespace(rotary_dim=rotary_dim, max_position_embeddings=max_position, base=base)
        owner._compute_inv_freq = types.MethodType(fns["compute_inv_freq"], owner)
        return fns["compute_cos_sin_cache"](owner)

    return types.SimpleNamespace(
        rms_norm=fns["rms_norm"],
        fused_add_rms_norm=fns["fused_add_rms_norm"],
        silu_and_mul=fns["silu_and_mul"],
        apply_rotary_emb=fns["apply_rotary_emb"],
        rotary_forward_static=fns["rotary_forward_static"],
        cos_sin_cache=cos_sin_cache,
        sources=where,
    )


# --- what the check runs ---------------------------------------------------------------------------------


@dataclass
class BundleOps:
    """Everything the check takes from the bundle on one device."""

    bundle: Any  # gpu_bundle_build.Bundle
    device: str
    natives: types.SimpleNamespace
    ops: Any = None  # torch.ops.rlalign_gpu (CUDA only)
    fi: Any = None  # torch.ops.rlalign_gpu_fi (CUDA only)
    notes: dict[str, str] = field(default_factory=dict)  # why a part is absent
    timing: dict[str, float] = field(default_factory=dict)
    anchors_missing: list[str] = field(default_factory=list)

    def options(self) -> dict[str, Any]:
        """vLLM's Inductor options on this device."""
        return inductor_options(self.device)

    def cos_sin_cache(
        self, head_size: int, max_position: int, base: float, dtype: torch.dtype
    ) -> torch.Tensor:
        """vLLM's cos_sin_cache as ``RotaryEmbeddingBase.__init__`` makes it: on the model's device, cast to
        the model dtype (``dtype=torch.float32``: SGLang's fp32 table, same formula)."""
        with torch.device(self.device):
            cache = self.natives.cos_sin_cache(head_size, max_position, base)
        return cache.to(dtype)

    def summary(self) -> dict[str, Any]:
        """What the JSON report records about the bundle."""
        m = self.bundle.manifest
        return {
            "path": str(self.bundle.path),
            "vllm": m["vllm"]["version"],
            "vllm_sdist_sha256": m["vllm"]["sdist_sha256"],
            "flashinfer": (m.get("flashinfer") or {}).get("version"),
            "builder_version": m["builder_version"],
            "kernels_built": self.ops is not None,
            "flashinfer_built": self.fi is not None,
            "natives": self.natives.sources,
            "inductor_options": self.options(),
            "anchors_missing": self.anchors_missing,
            "notes": self.notes,
            "timing": self.timing,
        }


def prepare(path: str | Path, device: str, build_dir: Path | None = None, *, flashinfer: bool = True,
            verbose: bool = False) -> BundleOps:  # fmt: skip
    """Open and verify the bundle, load the native ops, check the anchors and (on CUDA) build the kernels.

    A failed vLLM build raises (the check cannot run its vllm-eager rows); a failed FlashInfer build is a
    note (the sglang rows say why they are absent)."""
    t0 = time.time()
    bundle = build.open_bundle(path)
    out = BundleOps(bundle, device, load_natives(bundle), anchors_missing=check_anchors(bundle))
    out.timing["open_s"] = round(time.time() - t0, 1)
    sgl = bundle.manifest.get("sgl_kernel", {}).get("absent")
    if sgl:
        out.notes["sglang swiglu"] = sgl
    if device != "cuda":
        out.notes["vllm-eager"] = "the bundled CUDA kernels need a CUDA device"
        out.notes["sglang"] = "the bundled FlashInfer kernels need a CUDA device"
        return out
    build_dir = Path(build_dir or build.default_build_dir())
    t = time.time()
    out.ops = build.build_vllm_ops(bundle, build_dir, verbose=verbose)
    out.timing["build_vllm_s"] = round(time.time() - t, 1)
    if not flashinfer or bundle.fi_root is None:
        out.notes["sglang"] = (
            "not built (--no-flashinfer)" if bundle.fi_root else "the bundle has no FlashInfer"
        )
        return out
    t = time.time()
    try:
        out.fi = build.build_flashinfer_ops(bundle, build_dir, verbose=verbose)
    except Exception as exc:  # the vLLM rows still run; the sglang rows say why they are absent
        out.notes["sglang"] = f"FlashInfer build failed: {type(exc).__name__}: {str(exc)[-400:]}"
    out.timing["build_flashinfer_s"] = round(time.time() - t, 1)
    return out


# --- the engines' calls ----------------------------------------------------------------------------------


def eager_ops_functions(ops: Any) -> dict[str, Any]:
    """The vllm-eager calls on the built kernels, allocated as vLLM's Python wrappers allocate them."""

    def rms(x, w, eps):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # vllm/kernels/vllm_c.py rms_norm
        ops.rms_norm(out, x, w, eps)
        return out

    def add_rms(h, r, w, eps):
        h2, r2 = h.clone(), r.clone()
        ops.fused_add_rms_norm(h2, r2, w, eps)
        return h2, r2

    def silu(gu):
        out = torch.empty(*gu.shape[:-1], gu.shape[-1] // 2, dtype=gu.dtype, device=gu.device)
        ops.silu_and_mul(out, gu)
        return out

    def rope(pos, q, k, head_size, cache):
        q2, k2 = q.clone(), k.clone()
        ops.rotary_embedding(pos, q2, k2, head_size, cache, True)
        return q2, k2

    return {"rms": rms, "add_rms": add_rms, "silu": silu, "rope": rope}


def natives_functions(natives: types.SimpleNamespace) -> dict[str, Any]:
    """The four native ops under the names the check's compiled engine takes."""

    def rope(pos, q, k, head_size, cache):
        return natives.rotary_forward_static(pos, q, k, head_size, head_size, cache, True)

    return {
        "rms": natives.rms_norm,
        "add_rms": natives.fused_add_rms_norm,
        "silu": natives.silu_and_mul,
        "rope": rope,
    }


def flashinfer_functions(fi: Any) -> dict[str, Any]:
    """sgl-kernel's calls of FlashInfer's norm and RoPE kernels (``sgl_kernel/elementwise.py``); no SwiGLU
    (sgl-kernel's own ``silu_and_mul`` is not in any sdist)."""

    def rms(x, w, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(x2)
        fi.rmsnorm(out, x2, w, eps, False)
        return out.view(x.shape)

    def add_rms(h, r, w, eps):
        h2, r2 = h.clone(), r.clone()
        fi.fused_add_rmsnorm(h2, r2, w, eps, False)
        return h2, r2

    def rope(pos, q, k, head_size, cache):
        t = q.shape[0]
        q2, k2 = q.clone().view(t, -1, head_size), k.clone().view(t, -1, head_size)
        fi.apply_rope_pos_ids_cos_sin_cache(q2, k2, q2, k2, cache, pos, False)  # in place, not interleaved
        return q2.view(t, -1), k2.view(t, -1)

    return {"rms": rms, "add_rms": add_rms, "silu": None, "rope": rope}


def topk_softmax(ops: Any, logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple:
    """``fused_topk``'s call (``fused_topk_router.py``): fp32 weights, int32 ids, no bias, no padding mask."""
    t = logits.shape[0]
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    tok = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    ops.topk_softmax(w, ids, tok, logits, renormalize, None, None)
    return w, ids
