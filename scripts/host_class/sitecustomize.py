"""Imported at interpreter start by scripts/as_host_class.sh (this folder is put first on PYTHONPATH): torch's
CPU feature queries answer as the x86 host class named in RLALIGN_HOST_CLASS, in every process of the run
(test, engine child, Ray workers), so that vLLM loads that class's kernel build (``_C_AVX2`` / ``_C_AVX512``),
Inductor picks its vector ISA, and the project's host-derived expectations follow. The ATen, oneDNN and
Inductor ISA settings that go with it are set by the script, in the environment.

Nothing is imported here: the queries are replaced when ``torch.cpu`` is first imported (a meta-path finder
wraps its loader), so a process that never imports torch stays as light as without the hook."""

import importlib.abc
import importlib.machinery
import os
import sys

_OFF = {
    # AVX512 without BF16 (Skylake-SP): no AVX512-BF16, no VNNI, no AMX
    "avx512": (
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ),
}
_OFF["avx2"] = ("_is_avx512_supported", *_OFF["avx512"])  # AVX2 only (EPYC Rome/Milan, Haswell..Coffee Lake)


def _no() -> bool:
    return False


class _PatchTorchCpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.cpu" or self.loader is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for name in self.names:
            if hasattr(module, name):
                setattr(module, name, _no)


if os.environ.get("RLALIGN_HOST_CLASS") in _OFF:
    sys.meta_path.insert(0, _PatchTorchCpu(_OFF[os.environ["RLALIGN_HOST_CLASS"]]))
