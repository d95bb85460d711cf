"""The import rule: vLLM and matplotlib are imported only inside ``rlalign_verl/tools/diagnose/``.

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
    "align/engine_ops/attention_op.py": "opt-in attention region's engine-op: the engine's own CPU attention op",
    "align/engine_ops/moe_op.py": "opt-in moe_variant=engine-op: the engine's own CPU expert op",
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
        if rel.startswith("tools/diagnose/") or rel in ALLOWED:
            continue
        for name in _imported_names(ast.parse(path.read_text(), filename=rel)):
            top = name.split(".")[0]
            if top in HEAVY and not (
                top == "matplotlib" and rel.startswith("tools/report/")
            ):  # the report draws
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
    assert (
        len(graph) > 80 and "rlalign_verl.request.spec" in graph["rlalign_verl.align.patch"]
    )  # the scan sees the package
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


# The layers, bottom first: a module imports only from its own layer or a lower one. Layers on one row are
# siblings and never import each other (alignment and measurement are independent; so are the integrations
# and the tools). Written here, not read from the package, so that a new upward import fails this test.
LAYERS = [
    ("base",),
    ("catalog",),
    ("request",),
    ("align", "measure"),
    ("verl", "openrlhf", "tools"),
    ("main_ppo", "__main__"),
]


def _layer(module: str) -> tuple[int, str]:
    top = module.split(".")[1] if "." in module else ""
    for rank, row in enumerate(LAYERS):
        if top in row:
            return rank, top
    raise AssertionError(f"{module}: in no layer of LAYERS (add its folder to one)")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        if module == "rlalign_verl":
            continue
        rank, top = _layer(module)
        for target in targets:
            t_rank, t_top = _layer(target)
            if t_top != top and t_rank >= rank:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's top-level folders and modules (what a reader sees on disk)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module != "rlalign_verl":
            top = _layer(module)[1]
            rooms.setdefault(top, set()).update(_layer(t)[1] for t in targets if t != "rlalign_verl")
    return {room: targets - {room} for room, targets in rooms.items()}


def _levels(graph: dict[str, set[str]]) -> int:
    """The longest import chain (a node importing nothing is level 1)."""
    memo: dict[str, int] = {}

    def level(v: str) -> int:
        if v not in memo:
            memo[v] = 1 + max((level(w) for w in graph.get(v, ()) if w != "rlalign_verl"), default=0)
        return memo[v]

    return max(level(v) for v in graph)


def test_imports_run_only_down_the_layers():
    graph = _graph()
    assert _upward(graph) == []
    tops = {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert tops - {"__init__", "__main__"} == {name for row in LAYERS for name in row} - {"__main__"}
    assert _levels(_rooms(graph)) <= 8, _rooms(graph)


def test_the_layer_check_can_fail():
    graph = {
        "rlalign_verl.base.errors": {"rlalign_verl.catalog.profiles"},
        "rlalign_verl.align.patch": {"rlalign_verl.measure.verify"},
        "rlalign_verl.catalog.profiles": set(),
        "rlalign_verl.measure.verify": set(),
    }
    assert _upward(graph) == [
        "rlalign_verl.align.patch -> rlalign_verl.measure.verify",
        "rlalign_verl.base.errors -> rlalign_verl.catalog.profiles",
    ]
    assert _levels({"a": {"b"}, "b": {"c"}, "c": set()}) == 3


CORE = ("base", "catalog", "request", "align")
# a region added on the registry: its math (align/regions/NAME.py), its data and rules (catalog/profiles_NAME.py),
# read by its row (request/regions.py); no other core module knows it (issue 32: <= 3 core files)
REGION_FILES = {
    "tp": {
        "rlalign_verl.align.regions.tp",
        "rlalign_verl.catalog.profiles_tp",
        "rlalign_verl.request.regions",
    },
}


def _knowing(graph: dict[str, set[str]], region: str) -> set[str]:
    """The core modules that are, or import, the region's math or data module."""
    own = {f"rlalign_verl.align.regions.{region}", f"rlalign_verl.catalog.profiles_{region}"}
    return {
        m
        for m, targets in graph.items()
        if m.split(".")[1:2] and m.split(".")[1] in CORE and (m in own or own & targets)
    }


@pytest.mark.parametrize("region", sorted(REGION_FILES))
def test_a_registry_region_is_known_to_its_files_only(region: str):
    """Issue 32's bar for the tp region: adding it touched its math, its row and its data file (<= 3 core files);
    the profile table, the MoE planner, the family table and the precision helpers do not know it."""
    assert _knowing(_graph(), region) == REGION_FILES[region]
    assert len(REGION_FILES[region]) <= 3


def test_the_region_files_check_can_fail():
    graph = {
        "rlalign_verl.align.regions.tp": set(),
        "rlalign_verl.catalog.profiles_tp": set(),
        "rlalign_verl.align.moe_patch": {"rlalign_verl.align.regions.tp"},
        "rlalign_verl.tools.diagnose.ladder": {"rlalign_verl.catalog.profiles_tp"},
    }
    assert _knowing(graph, "tp") == {
        "rlalign_verl.align.regions.tp",
        "rlalign_verl.catalog.profiles_tp",
        "rlalign_verl.align.moe_patch",
    }


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
    assert (
        PACKAGE / "tools" / "diagnose" / "engine_floor.py"
    ).is_file()  # the excluded folder is the real one


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
import rlalign_verl.measure.metrics
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
