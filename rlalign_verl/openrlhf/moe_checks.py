"""MoE facts in OpenRLHF's flags, read for ``AlignmentSpec.validate`` (which refuses what it cannot follow).

The ``swiglu`` region mirrors each routed expert computed on its full weights and the ``moe`` region the
weighted combine of a token's experts rounded once, both on one rank. What breaks that:

- expert parallelism (each rank holds some experts; the ranks' partial outputs are all-reduced in bf16).
  OpenRLHF 0.11.2 cannot turn it on: ``openrlhf/trainer/ray/vllm_engine.py::create_vllm_engines`` builds
  the vLLM engines with fixed arguments (no ``enable_expert_parallel``) and its CLI declares no such flag.
  A flag naming it (another release, a fork) is refused for MoE models whenever swiglu or moe is aligned.
- ``--vllm.tensor_parallel_size`` > 1: vLLM splits every expert's intermediate dimension over the ranks
  (``fused_moe/config.py``: ``intermediate_size_per_partition = intermediate_size // tp_size``) and
  all-reduces the ranks' bf16 partial outputs (``fused_moe/runner/moe_runner.py::MoERunner.
  _maybe_reduce_final_output``, when ``tp_size > 1 or ep_size > 1``), so the combine rounds per rank:
  refused with the ``moe`` region (the expert SwiGLU is elementwise on the split and still mirrored).

The model type is read from the local ``config.json`` of ``--actor.model_name_or_path``; a model that is
not a local directory is not checked here (the workers still refuse unsupported routers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlalign_verl.openrlhf.flags import spellings


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--f v`` or ``--f=v``), else None."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return value


def local_model_type(argv: Sequence[str]) -> str | None:
    """The model type of a local checkpoint of a supported family given to OpenRLHF, else None."""
    from rlalign_verl.catalog.families import FAMILIES

    path = _flag(argv, spellings("model_path"))
    config = Path(path).expanduser() / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not ours to diagnose here: the workers' apply_alignment names the problem
    family = FAMILIES.get(data.get("model_type")) if isinstance(data, dict) else None
    return family.model_type if family is not None else None


def expert_parallel_flag(argv: Sequence[str]) -> str | None:
    """The first expert-parallel flag in ``argv`` (OpenRLHF 0.11.2 declares none; another release may), else None."""
    ep = [a.split("=", 1)[0] for a in argv if a.startswith("--") and "expert_parallel" in a]
    return ep[0] if ep else None


def moe_tensor_parallel(argv: Sequence[str]) -> int | None:
    """``--vllm.tensor_parallel_size`` as an int (None when absent or not a number: OpenRLHF's parser says so)."""
    tp = _flag(argv, spellings("vllm_tensor_parallel_size"))
    try:
        return None if tp in (None, "") else int(tp)
    except ValueError:
        return None
