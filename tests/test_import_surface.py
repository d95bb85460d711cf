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
            if name.split(".")[0] in HEAVY:
                offenders.append(f"{rel}: {name}")
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
