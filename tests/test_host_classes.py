"""scripts/test_host_classes.sh runs the host-class-dependent tests again as a smaller x86 class; its file list must
name every test file whose expectations read the host's class, or a new one would be checked on one class only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# reads the class (an attribute access, not a monkeypatched name) or uses the reference that does
READS_CLASS = re.compile(r"torch\.cpu\._is_\w+\(\)|from moe_engine_reference import|HOST_STORE\b")


def _listed() -> set[str]:
    text = (ROOT / "scripts" / "test_host_classes.sh").read_text()
    block = text[text.index("FILES=(") : text.index(")\n", text.index("FILES=("))]
    return set(re.findall(r"tests/\S+\.py", block))


def test_every_test_file_that_reads_the_host_class_is_listed() -> None:
    listed = _listed()
    assert listed and all((ROOT / f).is_file() for f in listed), sorted(
        f for f in listed if not (ROOT / f).is_file()
    )
    readers = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if READS_CLASS.search(p.read_text()) and "pytest.mark.grpo" not in p.read_text()
    }
    assert readers - listed == set(), f"add to scripts/test_host_classes.sh: {sorted(readers - listed)}"


@pytest.mark.slow
def test_the_class_hook_answers_as_the_class() -> None:
    """The hook replaces torch.cpu's queries when torch is imported, not before (a process without torch stays
    light), and only for the class asked for."""
    import os
    import subprocess
    import sys

    code = "import sys; a = 'torch' in sys.modules; import torch; print(a, torch.cpu._is_avx512_supported(), " \
        "torch.cpu._is_avx512_bf16_supported())"  # fmt: skip
    hook = str(ROOT / "scripts" / "host_class")
    runs = {}
    for cls in ("avx2", "avx512", ""):
        env = dict(os.environ, PYTHONPATH=hook, RLALIGN_HOST_CLASS=cls)
        runs[cls] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.split()  # fmt: skip
    assert runs["avx2"] == ["False", "False", "False"]
    assert runs["avx512"][:3:2] == ["False", "False"] and runs["avx512"][1] == str(_host_has("avx512f"))
    assert runs[""][0] == "False" and runs[""][2] == str(_host_has("avx512_bf16"))  # no class: the host's own


def _host_has(flag: str) -> bool:
    return flag in Path("/proc/cpuinfo").read_text().split()
