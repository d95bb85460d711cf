"""The import rule: vLLM and matplotlib are imported only inside ``rlalign_verl/diagnose/``.

A training worker imports ``rlalign_verl`` and calls ``apply_alignment``; neither may pull in the
inference engine or the plotting stack (checked on the real ``sys.modules`` of a fresh interpreter).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlalign_verl

PACKAGE = Path(rlalign_verl.__file__).resolve().parent
HEAVY = ("vllm", "matplotlib")
# path (relative to the package) -> why it may name vLLM: it patches vLLM inside vLLM's own process
ALLOWED = {
    "verl/cpu/fixes.py": "opt-in CPU adaptations (RLALIGN_VERL_CPU=1) patch the vLLM rollout server itself",
    "engine_ops/attention_op.py": "opt-in attention region's engine-op: the engine's own CPU attention op",
    "engine_ops/moe_op.py": "opt-in moe_variant=engine-op: the engine's own CPU expert op",
}


def _imported_names(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
    return names


def test_no_heavy_import_outside_diagnose():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("diagnose/") or rel in ALLOWED:
            continue
        for name in _imported_names(ast.parse(path.read_text(), filename=rel)):
            top = name.split(".")[0]
            if top in HEAVY and not (top == "matplotlib" and rel.startswith("report/")):  # the report draws
                offenders.append(f"{rel}: {name}")
    assert offenders == [], offenders


def _module_name(path: Path) -> str:
    parts = ["rlalign_verl", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _internal_imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every import of our own package in ``path`` (function-level ones included)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # annotation-only imports never run: leave them out
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "rlalign_verl":
                out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "rlalign_verl"]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a ``from pkg import module`` counts as that module)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for module, names in _internal_imports(path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_the_package_modules():
    """Lazy (function-level) imports count too: a cycle is a cycle whenever it is taken."""
    graph = _graph()
    assert len(graph) > 80 and "rlalign_verl.spec" in graph["rlalign_verl.patch"]  # the scan sees the package
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules():
    offenders = [
        f"{path.relative_to(PACKAGE)}: {module}.{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, names in _internal_imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert offenders == [], offenders


def test_the_scan_sees_every_import_form():
    """The scanner is not blind: each import form of a heavy module is found."""
    src = "import vllm\nfrom matplotlib import pyplot\ndef f():\n    importlib.import_module('vllm.x')\n"
    assert _imported_names(ast.parse(src)) == ["vllm", "matplotlib", "vllm.x"]
    assert (PACKAGE / "diagnose" / "engine_ops.py").is_file()  # the excluded folder is the real one


_WORKER = """
import json, sys
import torch
import rlalign_verl
from transformers import Qwen2Config, Qwen2ForCausalLM
cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
rlalign_verl.apply_alignment(model, engine="vllm-cpu")
model(input_ids=torch.tensor([[1, 2, 3]]))
import rlalign_verl.metrics
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
"""


@pytest.mark.slow
def test_worker_path_loads_neither_vllm_nor_matplotlib():
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER % (HEAVY,)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], loaded


def test_the_worker_check_can_fail():
    """The same probe reports a heavy module once something does import it."""
    code = (
        "import sys, json, matplotlib\nprint(json.dumps(sorted(m for m in sys.modules if m == 'matplotlib')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(proc.stdout) == ["matplotlib"]
