"""MoE settings in OpenRLHF's flags that the alignment cannot follow: refused by the launcher before Ray.

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

from ..errors import AlignmentError
from .flags import spellings

SUPPORTED = "supported: every expert of a token on one rank (vLLM tensor_parallel_size 1, no expert parallel)"


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--f v`` or ``--f=v``), else None."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return value


def moe_model_type(argv: Sequence[str]) -> str | None:
    """The model type of a local MoE checkpoint given to OpenRLHF, else None (dense, remote or unreadable)."""
    from ..families import FAMILIES

    model_type = local_model_type(argv)
    return model_type if model_type is not None and FAMILIES[model_type].experts is not None else None


def local_model_type(argv: Sequence[str]) -> str | None:
    """The model type of a local checkpoint of a supported family given to OpenRLHF, else None."""
    from ..families import FAMILIES

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


def check_moe_parallel(
    regions: Sequence[str], argv: Sequence[str], profile: str | None = None, unverified: tuple[str, ...] = ()
) -> None:
    """One-line error for expert parallel (swiglu/moe) or vLLM tensor parallel (moe) on an MoE model, and
    for ``profile``'s unverified MoE data without the opt-in ``unverified`` (checked here, before Ray, as in
    the workers)."""
    aligned = {"swiglu", "moe"} & set(regions)
    if not aligned:
        return
    model_type = moe_model_type(argv)
    if model_type is None:
        return
    ep = [a.split("=", 1)[0] for a in argv if a.startswith("--") and "expert_parallel" in a]
    if ep:
        raise AlignmentError(
            f"{ep[0]} on {model_type}: expert parallel sums the ranks' expert outputs in bf16, which the "
            f"{'/'.join(sorted(aligned))} region cannot mirror ({SUPPORTED}); drop {ep[0]}"
        )
    tp = _flag(argv, spellings("vllm_tensor_parallel_size"))
    if "moe" in regions and tp not in (None, "", "1"):
        raise AlignmentError(
            f"--vllm.tensor_parallel_size {tp} on {model_type}: vLLM splits each expert over the ranks and "
            f"all-reduces their bf16 partial outputs, so the moe region's single combine rounding does not hold "
            f"({SUPPORTED}); use --vllm.tensor_parallel_size 1 or drop moe from --alignment.regions"
        )
    if profile is not None:
        from ..moe_patch import check_moe_profile
        from ..profiles import get_profile

        check_moe_profile(model_type, get_profile(profile), tuple(regions), unverified)
