#!/usr/bin/env python
"""Build the bundle's CUDA kernels on the GPU machine (``torch.utils.cpp_extension``, this GPU's arch only).

* vLLM: its own kernels of ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and
  ``topk_softmax``, compiled from the unmodified bundled ``.cu`` files with the flags of vLLM's
  ``_C_stable_libtorch`` target (:data:`VLLM_CUDA_FLAGS`) behind our binding
  (``scripts/gpu_bundle_binding/rlalign_gpu_ops.cpp``) as ``torch.ops.rlalign_gpu.*``. The binding's
  schemas and host declarations are first compared with the bundled ``torch_bindings.cpp`` / ``ops.h``
  (:func:`schema_mismatches`): ``TORCH_BOX`` unboxes by the C++ signature, so they must agree.
* FlashInfer (what sgl-kernel wraps for the norms and RoPE): ``norm.cu`` / ``rope.cu`` with FlashInfer's
  JIT flags (:data:`FI_CUDA_FLAGS`), registered by FlashInfer's own ``TORCH_LIBRARY_FRAGMENT`` under
  ``torch.ops.rlalign_gpu_fi``.

Run alone it builds into ``--build-dir`` (default ``$RLALIGN_GPU_BUILD`` or ``/tmp/rlalign_gpu_build``), so
``scripts/gpu_device_check.sh`` builds both extensions in parallel before the check, which then finds them
built (ninja has nothing left to do) and loads them::

    python scripts/gpu_bundle_build.py --bundle gpu_bundle --only vllm

Exit 0: built and loaded; 1: the build failed (compiler output above); 2: the bundle is missing or changed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
BINDING = HERE / "gpu_bundle_binding" / "rlalign_gpu_ops.cpp"
SHIM_DIR = HERE / "gpu_bundle_binding" / "shim"
NAMESPACE = "rlalign_gpu"
FI_NAMESPACE = "rlalign_gpu_fi"
OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "topk_softmax")

VLLM_KERNELS = (
    "csrc/libtorch_stable/layernorm_kernels.cu",
    "csrc/libtorch_stable/activation_kernels.cu",
    "csrc/libtorch_stable/pos_encoding_kernels.cu",
    "csrc/libtorch_stable/moe/topk_softmax_kernels.cu",
)
VLLM_SCHEMA_FILES = ("csrc/libtorch_stable/torch_bindings.cpp", "csrc/libtorch_stable/moe/torch_bindings.cpp")
VLLM_HEADER_FILES = ("csrc/libtorch_stable/ops.h", "csrc/libtorch_stable/moe/moe_ops.h")
TORCH_STABLE_ABI = "0x020B000000000000ULL"  # vLLM 0.31.0 builds against the torch 2.11 stable ABI
_UNDO_NO_HALF = [  # cpp_extension always adds the -D__CUDA_NO_HALF*__ forms; vLLM's CUDA >= 12 build drops them
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]
VLLM_HOST_FLAGS = [
    "-std=c++20",
    "-O2",
    "-DNDEBUG",
    "-DUSE_CUDA",
    f"-DTORCH_TARGET_VERSION={TORCH_STABLE_ABI}",
]
VLLM_CUDA_FLAGS = [
    # vLLM's CMakeLists.txt / cmake/utils.cmake for _C_stable_libtorch: ENABLE_FP8, USE_CUDA (declares
    # aoti_torch_get_current_cuda_stream), the stable ABI version, C++20, RelWithDebInfo's -O2 (without
    # -g: it only slows the build), --expt-relaxed-constexpr, no fast-math
    "-DUSE_CUDA",
    f"-DTORCH_TARGET_VERSION={TORCH_STABLE_ABI}",
    "-DENABLE_FP8",
    "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
    *_UNDO_NO_HALF,
    "--expt-relaxed-constexpr",
    "-std=c++20",
    "-O2",
    "-DNDEBUG",
    # searched last: a toolkit with cuBLAS's headers uses its own <cublas_v2.h>
    *("-Xcompiler", "-idirafter", "-Xcompiler", str(SHIM_DIR)),
]
FI_SOURCES = ("csrc/norm.cu", "csrc/flashinfer_norm_ops.cu", "csrc/rope.cu", "csrc/flashinfer_rope_ops.cu")
FI_CUDA_FLAGS = [
    # flashinfer/jit/core.py + jit/cpp_ext.py of 0.3.1 (sgl-kernel's pin bc29697b for these files)
    "-O3",
    "-std=c++17",
    "-use_fast_math",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-static-global-template-stub=false",
    *(f"-DFLASHINFER_ENABLE_{t}" for t in ("F16", "BF16", "FP8_E4M3", "FP8_E5M2", "FP8_E8M0", "FP4_E2M1")),
    *_UNDO_NO_HALF,
]


class BundleError(Exception):
    """The bundle is missing, changed, or lacks what the check needs (a one-line reason)."""


_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)


@dataclass
class Bundle:
    """A verified bundle folder and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def vllm_root(self) -> Path:
        return self.path / self.manifest["vllm"]["root"]

    @property
    def fi_root(self) -> Path | None:
        fi = self.manifest.get("flashinfer")
        return self.path / fi["root"] if fi else None

    @property
    def vllm_version(self) -> str:
        return self.manifest["vllm"]["version"]


def open_bundle(path: str | Path) -> Bundle:
    """The bundle at ``path``, every file checked against its MANIFEST sha256 (:class:`BundleError` if not)."""
    path = Path(path)
    problems = importlib.import_module("gpu_bundle").verify(path)
    if problems:
        raise BundleError(
            f"{path}: not a usable bundle ({len(problems)} problem(s), first: {problems[0]}); "
            f"make it with: python scripts/gpu_bundle.py --out {path}"
        )
    return Bundle(path, json.loads((path / "MANIFEST.json").read_text()))


# --- schemas ---------------------------------------------------------------------------------------------

_DEF = re.compile(r"\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)", re.S)
_STR = re.compile(r"\"((?:[^\"\\]|\\.)*)\"")


def schemas(cpp_text: str) -> dict[str, str]:
    """``{op name: schema}`` of every ``.def("...")`` with a string schema (adjacent literals joined,
    whitespace normalised)."""
    out = {}
    for m in _DEF.finditer(cpp_text):
        schema = " ".join("".join(_STR.findall(m.group(1))).split())
        schema = re.sub(r"\s*,\s*", ", ", re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", schema)))
        out[schema.split("(", 1)[0]] = schema
    return out


def declarations(header_text: str) -> dict[str, str]:
    """``{function: parameter list}`` of every ``void f(...);`` declaration (comments and the
    ``torch::stable::`` qualifier dropped, whitespace normalised)."""
    text = re.sub(r"//[^\n]*", "", header_text).replace("torch::stable::", "")
    out = {}
    for m in re.finditer(r"\bvoid\s+(\w+)\s*\(([^;{]*)\)\s*;", text):
        out[m.group(1)] = " ".join(m.group(2).split())
    return out


def schema_mismatches(bundle: Bundle, binding: Path = BINDING) -> list[str]:
    """Where our binding's schemas or host declarations differ from the bundled vLLM's (empty: they agree)."""
    ours_text = binding.read_text()
    ours, our_decl = schemas(ours_text), declarations(ours_text)
    theirs: dict[str, str] = {}
    decl: dict[str, str] = {}
    for rel in VLLM_SCHEMA_FILES:
        theirs.update(schemas((bundle.vllm_root / rel).read_text()))
    for rel in VLLM_HEADER_FILES:
        decl.update(declarations((bundle.vllm_root / rel).read_text()))
    out = []
    for op in OPS:
        if ours.get(op) != theirs.get(op):
            out.append(f"schema of {op}: ours {ours.get(op)!r}, vLLM's {theirs.get(op)!r}")
        if our_decl.get(op) != decl.get(op):
            out.append(f"declaration of {op}: ours {our_decl.get(op)!r}, vLLM's {decl.get(op)!r}")
    return out


# --- building --------------------------------------------------------------------------------------------


def device_arch() -> str:
    """``TORCH_CUDA_ARCH_LIST`` for this GPU only (``"9.0"`` on the H200)."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def default_build_dir() -> Path:
    """``$RLALIGN_GPU_BUILD``, else ``/tmp/rlalign_gpu_build``."""
    return Path(os.environ.get("RLALIGN_GPU_BUILD", "/tmp/rlalign_gpu_build"))


def _build(name: str, sources: list[Path], includes: list[Path], cflags: list[str], cuda_flags: list[str],
           build_dir: Path, arch: str, verbose: bool) -> None:  # fmt: skip
    from torch.utils import cpp_extension

    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # this device's architecture only
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    out = build_dir / name
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(i) for i in includes],
        extra_cflags=list(cflags),
        extra_cuda_cflags=list(cuda_flags),
        is_python_module=False,
        build_directory=str(out),
        verbose=verbose,
    )


def vllm_ext_name(bundle: Bundle) -> str:
    """The extension's name (and build folder) for the bundled vLLM version."""
    return f"{NAMESPACE}_vllm{bundle.vllm_version.replace('.', '')}"


def build_vllm_ops(bundle: Bundle, build_dir: Path, arch: str | None = None, verbose: bool = False) -> Any:
    """Compile vLLM's kernels from the bundle, load them and return ``torch.ops.rlalign_gpu``."""
    bad = schema_mismatches(bundle)
    if bad:
        raise BundleError(f"our binding does not match vLLM {bundle.vllm_version}: {bad[0]}")
    root = bundle.vllm_root
    sources = [BINDING, *(root / k for k in VLLM_KERNELS)]
    _build(vllm_ext_name(bundle), sources, [root / "csrc"], VLLM_HOST_FLAGS, VLLM_CUDA_FLAGS, build_dir,
           arch or device_arch(), verbose)  # fmt: skip
    return getattr(torch.ops, NAMESPACE)


def build_flashinfer_ops(
    bundle: Bundle, build_dir: Path, arch: str | None = None, verbose: bool = False
) -> Any:
    """Compile FlashInfer's norm/RoPE kernels from the bundle and return ``torch.ops.rlalign_gpu_fi``."""
    root = bundle.fi_root
    if root is None:
        raise BundleError("the bundle has no FlashInfer sources (made with --no-flashinfer)")
    arch = arch or device_arch()
    if arch == "9.0":
        arch = "9.0a"  # FlashInfer's JIT builds sm_90a on compute capability 9.0
    _build(FI_NAMESPACE, [root / s for s in FI_SOURCES], [root / "include", root / "csrc"], ["-O3", "-std=c++17"],
           FI_CUDA_FLAGS, build_dir, arch, verbose)  # fmt: skip
    return getattr(torch.ops, FI_NAMESPACE)


def main(argv: list[str] | None = None) -> int:
    """Build (and load) one or both extensions; see the module docstring for the exit codes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="gpu_bundle", help="bundle folder (default ./gpu_bundle)")
    parser.add_argument("--build-dir", type=Path, default=None, help="default $RLALIGN_GPU_BUILD or /tmp/...")
    parser.add_argument("--only", choices=("vllm", "flashinfer"), default=None, help="build one extension")
    parser.add_argument("--arch", default=None, help="TORCH_CUDA_ARCH_LIST value (default: this GPU's)")
    parser.add_argument("--verbose", action="store_true", help="print the compiler commands")
    args = parser.parse_args(argv)
    try:
        bundle = open_bundle(args.bundle)
    except BundleError as exc:
        print(f"gpu_bundle_build: {exc}", file=sys.stderr)
        return 2
    build_dir = args.build_dir or default_build_dir()
    builders = {"vllm": build_vllm_ops, "flashinfer": build_flashinfer_ops}
    for name in [args.only] if args.only else list(builders):
        t0 = time.time()
        try:
            builders[name](bundle, build_dir, args.arch, args.verbose)
        except Exception as exc:  # the compiler's output is above; one line says which build failed
            print(
                f"gpu_bundle_build: {name} build failed: {type(exc).__name__}: {str(exc)[-300:]}",
                file=sys.stderr,
            )
            return 1
        print(f"gpu_bundle_build: {name} built and loaded in {time.time() - t0:.0f} s ({build_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
