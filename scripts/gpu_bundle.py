#!/usr/bin/env python
"""Make the GPU bundle: the engine sources the device check builds and runs, taken from the registry.

The GPU machine this project can be lent has no vLLM, SGLang or FlashInfer and no network, and a call
carries at most 64 MiB. So on the CPU machine this script fetches from PyPI the source distribution of
exactly the vLLM version the CUDA profiles claim (:data:`VLLM_VERSION`, tested against
``rlalign_verl/catalog/profiles.py``) and of the FlashInfer release SGLang's kernels are built on, checks each
sdist's sha256 against the one PyPI's JSON API gives, and copies out only what the device check needs:

* vLLM: the ``#include`` closure (computed, not listed) of the CUDA kernels of ``rms_norm``,
  ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and ``topk_softmax``; the op schemas
  (``torch_bindings.cpp``, ``ops.h``) that our binding is checked against; the Python files whose
  native ops the default compiled path runs, and the files vLLM's compile settings are read from;
* FlashInfer (what sgl-kernel wraps for the norms and RoPE): the closure of ``norm.cu`` / ``rope.cu``
  and their op registrations. sgl-kernel itself has no sdist on PyPI (binary wheels of ~500 MB only),
  so its own sources (``silu_and_mul``) cannot be bundled; the MANIFEST says so.

Files keep their path inside the sdist (``gpu_bundle/vllm-0.31.0/csrc/...``) and are byte-identical to it;
``MANIFEST.json`` records versions, sdist URLs and sha256, and every file's sha256 and size. The total is
checked against what a device call may carry (64 MiB minus the working tree that travels with it).

Usage::

    python scripts/gpu_bundle.py                  # -> ./gpu_bundle (git-ignored)
    python scripts/gpu_bundle.py --out DIR --vllm-version 0.31.0
    python scripts/gpu_bundle.py --verify DIR     # every file against MANIFEST.json (the device does this)

Downloads are cached in ``$RLALIGN_CACHE/sdist`` (default ``~/.cache/rlalign-verl/sdist``), with PyPI's
JSON answer, so a rerun is offline. ``--index`` (or ``$RLALIGN_PYPI_INDEX``) names another PyPI JSON API
root (a mirror). Exit 0: bundle written (or verified); 2: refused (a version PyPI does not have, a sha256
mismatch, an existing folder that is not a bundle, over the size limit) or, with ``--verify``, a bundle
missing or changed; always one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILDER_VERSION = 1
KIND = "rlalign-gpu-bundle"
DEFAULT_OUT = ROOT / "gpu_bundle"

VLLM_VERSION = "0.31.0"
"""The vLLM release the CUDA profiles (``vllm``, ``vllm-eager``) are read from (their provenance says so)."""
FLASHINFER_VERSION = "0.3.1"
"""The FlashInfer release of the commit sgl-kernel pins (bc29697b = v0.3.1-22, the sglang profile's
provenance); its norm/RoPE sources are byte-identical to that commit (only the MLA RoPE kernel differs)."""

CARRY_LIMIT = 64 * 2**20
"""What one device call may carry: the working tree plus the carried paths."""
MARGIN = 8 * 2**20
"""Left free under the limit for the tree growing between making the bundle and running the check."""


# vLLM 0.31.0 builds these ops for CUDA from csrc/libtorch_stable (CMakeLists.txt VLLM_STABLE_EXT_SRC and
# the _moe_C_stable_libtorch target); include root csrc (cmake/utils.cmake define_extension_target).
VLLM_SPEC = {
    "name": "vllm",
    "include_roots": ("csrc",),
    "seeds": (
        "csrc/libtorch_stable/layernorm_kernels.cu",
        "csrc/libtorch_stable/activation_kernels.cu",
        "csrc/libtorch_stable/pos_encoding_kernels.cu",
        "csrc/libtorch_stable/moe/topk_softmax_kernels.cu",
    ),
    "files": (
        # op schemas and host signatures (our binding re-registers these; checked, not compiled)
        "csrc/libtorch_stable/torch_bindings.cpp",
        "csrc/libtorch_stable/ops.h",
        "csrc/libtorch_stable/moe/torch_bindings.cpp",
        "csrc/libtorch_stable/moe/moe_ops.h",
        # native ops the default (compiled) CUDA path runs, loaded standalone by scripts/gpu_bundle_natives.py
        "vllm/ir/ops/layernorm.py",
        "vllm/model_executor/layers/activation.py",
        "vllm/model_executor/layers/rotary_embedding/base.py",
        "vllm/model_executor/layers/rotary_embedding/common.py",
        # where the compile settings and the op choice are read from (anchors checked on the device)
        "vllm/config/compilation.py",
        "vllm/config/vllm.py",
        "vllm/compilation/compiler_interface.py",
        "vllm/platforms/cuda.py",
        "vllm/model_executor/layers/fused_moe/router/fused_topk_router.py",
        "CMakeLists.txt",
        "LICENSE",
    ),
}
FLASHINFER_SPEC = {
    "name": "flashinfer_python",
    "include_roots": ("include", "csrc"),
    "seeds": (
        "csrc/norm.cu",
        "csrc/flashinfer_norm_ops.cu",
        "csrc/rope.cu",
        "csrc/flashinfer_rope_ops.cu",
        "include/flashinfer/activation.cuh",
    ),
    "files": ("LICENSE", "version.txt"),
}
SGL_KERNEL_ABSENT = (
    "sgl-kernel has no source distribution on PyPI (binary wheels of ~500 MB only), so its own kernels "
    "(silu_and_mul, the MoE gate) cannot be bundled; the sglang rows cover the FlashInfer norms and RoPE"
)


_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)


sdist = importlib.import_module("gpu_bundle_sdist")
Refused = sdist.Refused


# --- size -----------------------------------------------------------------------------------------------


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree a device call carries besides the bundle (tracked + untracked, not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for name in out.decode().split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def bundle_limit(tree: int, max_bytes: int | None = None) -> int:
    """Bytes the bundle may take beside a ``tree``-byte working tree (at most ``max_bytes`` when given)."""
    limit = CARRY_LIMIT - tree - MARGIN
    return limit if max_bytes is None else min(limit, max_bytes)


# --- build ----------------------------------------------------------------------------------------------


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        manifest = out / "MANIFEST.json"
        try:
            ok = json.loads(manifest.read_text()).get("kind") == KIND
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise Refused(
                f"{out} exists and is not a GPU bundle (no MANIFEST.json of kind {KIND}); not overwriting"
            )


def _take(spec: dict, path: Path) -> tuple[str, dict[str, bytes], dict]:
    prefixes = tuple(sorted({r + "/" for r in spec["include_roots"]} | set(spec["files"])))
    top, files = sdist.read_sources(path, prefixes)
    closure, external = sdist.include_closure(files, spec["seeds"], spec["include_roots"])
    absent = [f for f in spec["files"] if f not in files]
    if absent:
        raise Refused(f"{path.name} lacks {absent}")
    chosen = {p: files[p] for p in sorted(set(closure) | set(spec["files"]))}
    return top, chosen, {"cuda_closure": closure, "external_includes": external}


def build(
    out: Path,
    vllm_version: str = VLLM_VERSION,
    fi_version: str | None = FLASHINFER_VERSION,
    *,
    index: str | None = None,
    max_bytes: int | None = None,
) -> dict:
    """Write the bundle to ``out`` (atomically replacing an earlier bundle) and return its manifest."""
    out = out.resolve()
    _check_out(out)
    t0 = time.time()
    parts = [("vllm", VLLM_SPEC, vllm_version)]
    if fi_version:
        parts.append(("flashinfer", FLASHINFER_SPEC, fi_version))
    manifest: dict = {"kind": KIND, "builder_version": BUILDER_VERSION, "created": time.strftime("%Y-%m-%d")}
    entries = []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for key, spec, version in parts:
            info = sdist.sdist_info(spec["name"], version, index)
            top, chosen, detail = _take(spec, sdist.fetch_sdist(info))
            for rel, data in chosen.items():
                dest = tmp / top / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                entries.append(
                    {"path": f"{top}/{rel}", "sha256": sdist.sha256(data), "size": len(data), "source": key}
                )
            manifest[key] = {
                "package": spec["name"],
                "version": version,
                "root": top,
                "sdist": info["filename"],
                "sdist_url": info["url"],
                "sdist_sha256": info["sha256"],
                "sdist_size": info["size"],
                **detail,
            }
        manifest["sgl_kernel"] = {"absent": SGL_KERNEL_ABSENT}
        total = sum(e["size"] for e in entries)
        tree = tree_bytes()
        limit = bundle_limit(tree, max_bytes)
        manifest.update(
            files=entries,
            file_count=len(entries),
            total_bytes=total,
            size_check={"tree_bytes": tree, "carry_limit": CARRY_LIMIT, "margin": MARGIN, "limit": limit},
        )
        if total > limit:
            raise Refused(f"the bundle is {total} B, over the {limit} B it may take (working tree {tree} B)")
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    manifest["seconds"] = round(time.time() - t0, 1)
    return manifest


def verify(bundle: Path) -> list[str]:
    """What is wrong with a bundle on disk (empty: every listed file is there with its sha256 and size,
    nothing else is, and the manifest is of this builder's kind and version)."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        return [f"{bundle}: no such folder"]
    try:
        manifest = json.loads((bundle / "MANIFEST.json").read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{bundle}/MANIFEST.json unreadable ({type(exc).__name__}: {exc})"]
    if manifest.get("kind") != KIND or manifest.get("builder_version") != BUILDER_VERSION:
        return [f"{bundle}: not a GPU bundle of builder version {BUILDER_VERSION}"]
    bad = []
    listed = set()
    for e in files:
        p = bundle / e["path"]
        listed.add(e["path"])
        if not p.is_file():
            bad.append(f"missing {e['path']}")
            continue
        data = p.read_bytes()
        if len(data) != e["size"] or sdist.sha256(data) != e["sha256"]:
            bad.append(f"changed {e['path']}")
    extra = [
        p.relative_to(bundle).as_posix()
        for p in bundle.rglob("*")
        if p.is_file() and p.name != "MANIFEST.json" and p.relative_to(bundle).as_posix() not in listed
    ]
    bad += [f"not in the manifest: {x}" for x in sorted(extra)]
    return bad


def _verify_main(bundle: Path) -> int:
    problems = verify(bundle)
    if problems:
        print(
            f"gpu_bundle: {bundle} is not a usable bundle ({len(problems)} problem(s), first: {problems[0]}); "
            f"make it with: python scripts/gpu_bundle.py --out {bundle}",
            file=sys.stderr,
        )
        return 2
    m = json.loads((bundle / "MANIFEST.json").read_text())
    fi = (m.get("flashinfer") or {}).get("version", "none")
    print(
        f"gpu_bundle: {bundle} verified ({m['file_count']} files, vllm {m['vllm']['version']}, flashinfer {fi})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Make (or ``--verify``) the bundle; see the module docstring for the exit codes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="bundle folder (default ./gpu_bundle)")
    parser.add_argument("--vllm-version", default=VLLM_VERSION)
    parser.add_argument("--flashinfer-version", default=FLASHINFER_VERSION)
    parser.add_argument("--no-flashinfer", action="store_true", help="vLLM sources only")
    parser.add_argument("--index", default=None, help=f"PyPI JSON API root (default {sdist.PYPI_INDEX})")
    parser.add_argument("--max-bytes", type=int, default=None, help="refuse a bundle larger than this")
    parser.add_argument(
        "--verify", type=Path, default=None, metavar="DIR", help="check a bundle, build nothing"
    )
    args = parser.parse_args(argv)
    if args.verify is not None:
        return _verify_main(args.verify)
    fi = None if args.no_flashinfer else args.flashinfer_version
    try:
        m = build(args.out, args.vllm_version, fi, index=args.index, max_bytes=args.max_bytes)
    except Refused as exc:
        print(f"gpu_bundle: refused: {exc}", file=sys.stderr)
        return 2
    per = {k: sum(1 for e in m["files"] if e["source"] == k) for k in ("vllm", "flashinfer")}
    print(
        f"gpu_bundle: wrote {args.out} ({m['file_count']} files: vllm {per['vllm']}, flashinfer "
        f"{per['flashinfer']}; {m['total_bytes']} B of {m['size_check']['limit']} B allowed) in {m['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
