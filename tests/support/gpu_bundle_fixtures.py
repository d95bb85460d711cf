"""Helpers of tests/tools/test_gpu_bundle.py: the GPU scripts loaded by path, synthetic sdists and a local index.

``tests/support`` is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml).
:class:`FakeIndex` is a PyPI-style JSON API on 127.0.0.1 (loopback only: the tests need no network) that
serves synthetic source distributions made by :func:`make_sdist`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import sys
import tarfile
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def load_script(name: str) -> types.ModuleType:
    """``scripts/<name>.py`` as module ``name`` (once; dataclasses resolve it through ``sys.modules``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_sdist(top: str, files: dict[str, bytes]) -> bytes:
    """A ``.tar.gz`` whose members are ``top/<path>`` (plus a directory entry and a symlink, which the
    builder must skip)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        d = tarfile.TarInfo(top)
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        for rel, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"{top}/csrc/a_link.h")
        link.type, link.linkname = tarfile.SYMTYPE, "cuda_compat.h"
        tar.addfile(link)
    return buf.getvalue()


VLLM_CUDA = {
    # the seeds: quoted includes (same folder, ../, include root), angled includes (toolkit, torch),
    # a commented-out include (not followed) and a conditional one (followed: a superset is harmless)
    "csrc/libtorch_stable/layernorm_kernels.cu": b'#include "type_convert.cuh"\n#include "../cuda_compat.h"\n'
    b'#include <cub/cub.cuh>\n#include "core/batch_invariant.hpp"\n',
    "csrc/libtorch_stable/activation_kernels.cu": b'#include "cuda_vec_utils.cuh"\n  #  include "dispatch_utils.h"\n',
    "csrc/libtorch_stable/pos_encoding_kernels.cu": b'#include "torch_utils.h"\n// #include "unused.h"\n'
    b"#include <torch/csrc/stable/tensor.h>\n",
    "csrc/libtorch_stable/moe/topk_softmax_kernels.cu": b'#include "../cub_helpers.h"\n#ifdef USE_ROCM\n'
    b'#include "../rocm_only.h"\n#endif\n',
    # the headers they reach
    "csrc/libtorch_stable/type_convert.cuh": b'#include "quantization/vectorization.cuh"\n#include <cuda_bf16.h>\n',
    "csrc/libtorch_stable/quantization/vectorization.cuh": b"#pragma once\n",
    "csrc/cuda_compat.h": b"#pragma once\n",
    "csrc/core/batch_invariant.hpp": b'#include "../cuda_compat.h"\n',
    "csrc/libtorch_stable/cuda_vec_utils.cuh": b'#include "type_convert.cuh"\n',
    "csrc/libtorch_stable/dispatch_utils.h": b"#include <torch/headeronly/core/Dispatch.h>\n",
    "csrc/libtorch_stable/torch_utils.h": b"#include <cublas_v2.h>\n",
    "csrc/libtorch_stable/cub_helpers.h": b"#pragma once\n",
    "csrc/libtorch_stable/rocm_only.h": b"#pragma once\n",
}
VLLM_REACHED = {
    "csrc/libtorch_stable/type_convert.cuh",
    "csrc/libtorch_stable/quantization/vectorization.cuh",
    "csrc/cuda_compat.h",
    "csrc/core/batch_invariant.hpp",
    "csrc/libtorch_stable/cuda_vec_utils.cuh",
    "csrc/libtorch_stable/dispatch_utils.h",
    "csrc/libtorch_stable/torch_utils.h",
    "csrc/libtorch_stable/cub_helpers.h",
    "csrc/libtorch_stable/rocm_only.h",
}
VLLM_EXTERNAL = {
    "cub/cub.cuh",
    "cuda_bf16.h",
    "torch/headeronly/core/Dispatch.h",
    "torch/csrc/stable/tensor.h",
    "cublas_v2.h",
}
UNRELATED = {
    # under an include root but reached by nothing, or outside what the builder reads
    "csrc/libtorch_stable/unused.h": b"#pragma once\n",
    "csrc/libtorch_stable/unused_kernels.cu": b'#include "unused.h"\n',
    "csrc/attention/attention_kernels.cu": b'#include "../cuda_compat.h"\n',
    "vllm/other.py": b"x = 1\n",
    "docs/index.md": b"# docs\n",
    "setup.py": b"print('setup')\n",
}
FI_CUDA = {
    "csrc/norm.cu": b'#include <flashinfer/norm.cuh>\n#include "pytorch_extension_utils.h"\n',
    "csrc/flashinfer_norm_ops.cu": b'#include "pytorch_extension_utils.h"\n',
    "csrc/rope.cu": b'#include <flashinfer/pos_enc.cuh>\n#include "pytorch_extension_utils.h"\n',
    "csrc/flashinfer_rope_ops.cu": b'#include "pytorch_extension_utils.h"\n',
    "csrc/pytorch_extension_utils.h": b"#include <torch/extension.h>\n",
    "include/flashinfer/norm.cuh": b'#include "utils.cuh"\n',
    "include/flashinfer/pos_enc.cuh": b'#include "utils.cuh"\n',
    "include/flashinfer/activation.cuh": b'#include "utils.cuh"\n',
    "include/flashinfer/utils.cuh": b"#pragma once\n",
}
FI_UNRELATED = {
    "include/flashinfer/attention/decode.cuh": b"#pragma once\n",
    "3rdparty/cutlass/include/cutlass/cutlass.h": b"#pragma once\n",
}


def vllm_files(spec_files: tuple[str, ...]) -> dict[str, bytes]:
    """A synthetic vLLM sdist's files: :data:`VLLM_CUDA`, the builder's listed files, :data:`UNRELATED`."""
    listed = {f: f"# {f}\n".encode() for f in spec_files}
    return {**VLLM_CUDA, **listed, **UNRELATED}


def fi_files(spec_files: tuple[str, ...]) -> dict[str, bytes]:
    """A synthetic FlashInfer sdist's files."""
    return {**FI_CUDA, **{f: f"{f}\n".encode() for f in spec_files}, **FI_UNRELATED}


class FakeIndex:
    """A PyPI JSON API on loopback: ``add`` a release; ``url`` is the index root; ``requests`` lists paths.

    A release is served at the release endpoint, or (``project_only``) only in the project endpoint's
    ``releases``, as some front ends do. ``sha256`` overrides the digest the index claims.
    """

    def __init__(self) -> None:
        self.routes: dict[str, bytes] = {}
        self.projects: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                index.requests.append(self.path)
                body = index.routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.base}/pypi"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    def add(self, name: str, version: str, top: str, files: dict[str, bytes], *, sha256: str | None = None,
            project_only: bool = False) -> bytes:  # fmt: skip
        """Serve ``files`` as the sdist ``top.tar.gz`` of ``name==version``; returns the tarball."""
        data = make_sdist(top, files)
        filename = f"{top}.tar.gz"
        self.routes[f"/files/{filename}"] = data
        entry = {
            "packagetype": "sdist",
            "filename": filename,
            "url": f"{self.base}/files/{filename}",
            "digests": {"sha256": sha256 or hashlib.sha256(data).hexdigest()},
            "size": len(data),
        }
        wheel = {**entry, "packagetype": "bdist_wheel", "filename": f"{top}-py3-none-any.whl"}
        releases = self.projects.setdefault(name, {})
        releases[version] = [wheel, entry]
        self.routes[f"/pypi/{name}/json"] = json.dumps({"releases": releases}).encode()
        if not project_only:
            self.routes[f"/pypi/{name}/{version}/json"] = json.dumps({"urls": [wheel, entry]}).encode()
        return data

    def __enter__(self) -> FakeIndex:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
