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

The model type and config are read from the checkpoint by :mod:`rlalign_verl.openrlhf.model_checks`, and the rollout's
TP size from ``--vllm.tensor_parallel_size`` there too.
"""

from __future__ import annotations

from collections.abc import Sequence


def expert_parallel_flag(argv: Sequence[str]) -> str | None:
    """The first expert-parallel flag in ``argv`` (OpenRLHF 0.11.2 declares none; another release may), else None."""
    ep = [a.split("=", 1)[0] for a in argv if a.startswith("--") and "expert_parallel" in a]
    return ep[0] if ep else None
