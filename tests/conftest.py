"""Shared fixtures: tiny local checkpoints and rollouts from the real vLLM CPU engine.

- ``tiny_checkpoint(arch="qwen2") -> Path``: the deterministic tiny checkpoint (built once into the
  cache, ``$RLALIGN_CACHE`` or ``~/.cache/rlalign-verl/tiny``; set ``RLALIGN_TEST_FRESH_TINY=1`` to build
  into the session's tmp dir instead).
- ``qwen2_path -> str``: the tiny Qwen2 checkpoint's directory (``tiny_checkpoint("qwen2")``).
- ``engine_rollouts(arch="qwen2", mode="compiled", tp=1) -> EngineRollouts``: 32 prompts x 32 tokens
  sampled by the real vLLM engine (seed 0, tensor parallel ``tp``) with their engine log-probs. The first
  call generates every combination in ``ENGINE_COMBOS`` (plus the one asked for) in ONE engine child
  process; later calls read the cache. Skips cleanly when vLLM is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# A helper module under tests/support whose fixtures the tests load with pytest_plugins: its asserts are
# rewritten (pytest warns, and reports bare asserts, when such a module is imported before it is marked).
pytest.register_assert_rewrite("callback_steps", "fit_harness", "browser")

for _k, _v in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    # the tiny Qwen2-MoE with its shared expert's down projection at K=384: exact claims on CPU hold for K < 512
    # (docs/results-cpu.md), and the shipped tiny one's K=512 at rollout TP 1 (256 per rank at TP 2)
    "qwen2_moe_k384": ("qwen2_moe", {"shared_expert_intermediate": 384}),
}
"""Test-only shapes of the tiny architectures: name -> (architecture, changed ``TinySpec`` fields)."""

ENGINE_COMBOS: tuple[tuple[str, str, int], ...] = (
    ("qwen2", "compiled", 1),
    ("qwen2", "eager", 1),
    ("qwen3", "compiled", 1),
    ("qwen3", "eager", 1),
    ("qwen2", "compiled", 2),
    ("qwen2", "eager", 2),
    ("qwen3_moe", "eager", 2),
    ("qwen2_moe", "eager", 2),
    ("qwen2_moe", "compiled", 2),
    ("qwen3_moe", "compiled", 1),
    ("qwen2_moe_k384", "compiled", 1),
)
"""(arch, mode, tensor parallel) generated together on the first ``engine_rollouts`` request. Override with
``RLALIGN_ENGINE_COMBOS="qwen2:compiled,qwen3:eager:2"`` (or ``none`` to generate only what is asked)."""

ENGINE_NUM_PROMPTS = 32
ENGINE_MAX_TOKENS = 32
ENGINE_SEED = 0


@dataclass
class EngineRollouts:
    """Rollouts of one (arch, mode) from the real engine."""

    arch: str
    mode: str
    tp: int
    model_dir: Path
    path: Path
    header: object  # rlalign_verl.tools.diagnose.rollouts.RolloutHeader
    rollouts: list  # list[rlalign_verl.tools.diagnose.rollouts.Rollout]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_checkpoint(arch="qwen2") -> Path`` of a built tiny HF checkpoint (``arch``: a tiny
    architecture of ``diagnose --tiny``, or a test variant of one in ``TINY_VARIANTS``)."""
    import dataclasses

    from rlalign_verl.tools.diagnose.tiny import SPECS, TINY_VERSION, build_tiny_checkpoint, tiny_cache_root

    fresh = os.environ.get("RLALIGN_TEST_FRESH_TINY") == "1"
    built: dict[str, Path] = {}

    def get(arch: str = "qwen2") -> Path:
        if arch not in built:
            path = tmp_path_factory.mktemp("tiny") / arch if fresh else None
            if arch in TINY_VARIANTS:
                base, fields = TINY_VARIANTS[arch]
                path = path or tiny_cache_root() / f"{arch}-v{TINY_VERSION}"
                built[arch] = build_tiny_checkpoint(
                    base, path, spec=dataclasses.replace(SPECS[base], **fields)
                )
            else:
                built[arch] = build_tiny_checkpoint(arch, path)
        return built[arch]

    return get


@pytest.fixture
def qwen2_path(tiny_checkpoint: Callable[..., Path]) -> str:
    """The tiny Qwen2 checkpoint's directory, as a string (what a config's ``model.path`` takes)."""
    return str(tiny_checkpoint("qwen2"))


def _combos_to_prefetch() -> list[tuple[str, str, int]]:
    env = os.environ.get("RLALIGN_ENGINE_COMBOS")
    if env is None:
        return list(ENGINE_COMBOS)
    if env.strip().lower() in ("", "none"):
        return []
    out = []
    for item in env.split(","):
        arch, _, rest = item.strip().partition(":")
        mode, _, tp = rest.partition(":")
        out.append((arch, mode or "compiled", int(tp or 1)))
    return out


@pytest.fixture(scope="session")
def engine_rollouts(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., EngineRollouts]:
    """Factory: ``engine_rollouts(arch="qwen2", mode="compiled", tp=1) -> EngineRollouts`` (cached per session)."""
    from rlalign_verl.tools.diagnose.rollouts import read_rollouts
    from rlalign_verl.tools.diagnose.runner import (
        EngineJob,
        EngineUnavailableError,
        engine_distribution,
        run_engine_jobs,
    )
    from rlalign_verl.tools.diagnose.tiny import tiny_prompts

    cache: dict[tuple[str, str, int], EngineRollouts] = {}
    out_dir = tmp_path_factory.mktemp("engine_rollouts")

    def get(arch: str = "qwen2", mode: str = "compiled", tp: int = 1) -> EngineRollouts:
        if mode not in ("compiled", "eager"):
            raise ValueError(f"mode must be 'compiled' or 'eager', not {mode!r}")
        key = (arch, mode, tp)
        if key in cache:
            return cache[key]
        if engine_distribution() is None:
            pytest.skip("vLLM is not installed (pip install 'rlalign-verl[engine]' for the CPU build)")
        wanted = [key] + [c for c in _combos_to_prefetch() if c != key and c not in cache]
        from transformers import AutoTokenizer

        jobs = []
        for a, m, t in wanted:
            model_dir = tiny_checkpoint(a)
            tok = AutoTokenizer.from_pretrained(model_dir)
            prompts = tiny_prompts(tok, ENGINE_NUM_PROMPTS)
            jobs.append(
                EngineJob(
                    model_dir=str(model_dir),
                    prompts=prompts,
                    max_tokens=ENGINE_MAX_TOKENS,
                    out=str(out_dir / f"{a}-{m}-tp{t}.jsonl"),
                    seed=ENGINE_SEED,
                    enforce_eager=(m == "eager"),
                    tensor_parallel_size=t,
                )
            )
        try:
            paths = run_engine_jobs(jobs, log_path=out_dir / f"engine-{arch}-{mode}.log")
        except EngineUnavailableError as e:
            pytest.fail(f"the vLLM engine failed: {e}")
        for (a, m, t), p in zip(wanted, paths, strict=True):
            header, rollouts = read_rollouts(p)
            cache[(a, m, t)] = EngineRollouts(a, m, t, tiny_checkpoint(a), p, header, rollouts)
        return cache[key]

    return get
