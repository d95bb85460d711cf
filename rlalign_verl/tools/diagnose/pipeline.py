"""The steps of ``diagnose``: sample (or read) rollouts, recompute per setting, the floor, the op probe.

Every step takes the frozen :class:`~.options.DiagnoseOptions` and the :class:`Sample`, and records its
wall time in ``timing``. :mod:`.command` strings them together.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.tools.diagnose.options import DiagnoseOptions
from rlalign_verl.tools.diagnose.progress import stage
from rlalign_verl.tools.diagnose.resolve import (
    check_model,
    check_settings,
    profile_for_dump,
    profile_for_engine,
)
from rlalign_verl.tools.diagnose.stats import intervals, prompt_groups


@dataclass(frozen=True)
class Sample:
    """The rollouts to diagnose and where they come from."""

    model_dir: Path
    config: Any  # transformers PretrainedConfig
    profile: Any  # EngineProfile
    header: Any  # RolloutHeader
    rollouts: list
    source: str  # "engine" | "dump"
    dump_path: Path
    temperature: float = 1.0
    """What the engine divided its logits by before the log-softmax of the log-probs it reported
    (:func:`.dump_header.logprob_temperature`); the recompute does the same."""

    @property
    def prompts(self) -> int:
        """The distinct prompts: the units the intervals resample (a recommendation needs enough of them)."""
        return len(set(prompt_groups(self.rollouts)))

    @property
    def tp(self) -> int:
        """The rollout's tensor-parallel size (the header's): the ``tp`` region and the floor mirror it."""
        return int(self.header.tensor_parallel_size)


def sample_from_dump(opts: DiagnoseOptions, settings: list) -> Sample:
    """Read ``--rollout-logprobs``; the model is ``--model``/``--tiny`` or the dump's own checkpoint. ``settings``
    are checked against the dump's profile, TP size and model before anything is recomputed."""
    from rlalign_verl.tools.diagnose.dump_header import logprob_temperature
    from rlalign_verl.tools.diagnose.rollouts import (
        RolloutFormatError,
        check_model_identity,
        model_limits,
        read_rollouts,
    )
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint

    dump = Path(opts.rollout_logprobs)
    if not dump.is_file():
        raise RolloutFormatError(f"--rollout-logprobs {dump}: no such file")
    header_only, _ = read_rollouts(dump)
    model = opts.model
    if model is None and opts.tiny is None:
        if not Path(header_only.model).is_dir():
            raise AlignmentError(
                f"{dump} was generated from {header_only.model}, which is not on this machine; "
                f"pass --model DIR with the same checkpoint"
            )
        model = header_only.model
    model_dir = Path(model) if model else build_tiny_checkpoint(opts.tiny or "qwen2")
    config, _ = check_model(model_dir)
    check_model_identity(dump, header_only, model_dir)
    header, rollouts = read_rollouts(dump, **model_limits(config))
    profile = profile_for_dump(opts.engine, header, dump)
    check_tp(config, model_dir, header.tensor_parallel_size, where=f"{dump}: header tensor_parallel_size")
    check_settings(settings, profile, header.tensor_parallel_size, config)
    return Sample(model_dir, config, profile, header, rollouts, "dump", dump, logprob_temperature(header))


def sample_with_engine(
    opts: DiagnoseOptions, dist: tuple[str, str], out_dir: Path, timing: dict, settings: list
) -> Sample:
    """Sample ``num_prompts`` x ``seeds`` responses with the installed engine (one child process), after
    ``settings`` are checked against the profile, the TP size and the model."""
    from rlalign_verl.tools.diagnose.dump_header import logprob_temperature
    from rlalign_verl.tools.diagnose.head import engine_hf_overrides
    from rlalign_verl.tools.diagnose.rollouts import model_limits, read_rollouts
    from rlalign_verl.tools.diagnose.runner import EngineJob, run_engine_jobs
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint, tiny_prompts

    profile = profile_for_engine(opts.engine, dist)
    t = time.time()
    if opts.model:
        model_dir = Path(opts.model)
    else:
        with stage(f"build tiny {opts.tiny or 'qwen2'} model"):
            model_dir = build_tiny_checkpoint(opts.tiny or "qwen2")
    config, tok = check_model(model_dir)
    check_tp(config, model_dir, opts.tp, profile)
    check_settings(settings, profile, opts.tp, config)
    timing["model_build_s"] = time.time() - t
    prompts = tiny_prompts(tok, opts.num_prompts, seed=opts.seed)
    check_context(config, model_dir, prompts, opts.max_tokens)
    dump = Path(opts.write_rollouts) if opts.write_rollouts else out_dir / "rollouts.jsonl"
    # --seeds N: every prompt N times; per-request seeds differ by index, so the repeats are independent
    job = EngineJob(
        model_dir=str(model_dir),
        prompts=prompts * opts.seeds,
        max_tokens=opts.max_tokens,
        out=str(dump),
        seed=opts.seed,
        temperature=opts.temperature,
        enforce_eager=profile.name.endswith("-eager"),
        hf_overrides=engine_hf_overrides(opts.engine_head_dtype),
        tensor_parallel_size=opts.tp,
    )
    n = opts.num_prompts * opts.seeds
    t = time.time()
    tp = f", tensor parallel {opts.tp}" if opts.tp > 1 else ""
    with stage(f"generate {n}x{opts.max_tokens} tokens with {dist[0]} {dist[1]} ({profile.name}{tp})"):
        run_engine_jobs([job], log_path=out_dir / "engine.log")
    timing["engine_s"] = time.time() - t
    header, rollouts = read_rollouts(dump, **model_limits(config))
    return Sample(model_dir, config, profile, header, rollouts, "engine", dump, logprob_temperature(header))


def check_tp(config: Any, model_dir: Path, tp: int, profile: Any = None, where: str = "--tp") -> None:
    """Refuse, before the engine starts (or the dump is recomputed), a TP size this diagnosis cannot mirror: one that
    does not split the model and (running the engine here) a size the profile does not model."""
    if tp == 1:
        return
    from rlalign_verl.catalog.profiles_tp import unmodelled_size, unsplittable

    split = unsplittable(config, tp)
    if split:
        raise AlignmentError(
            f"{where} {tp}: the model's {split} ({model_dir}) is not divisible by it, so vLLM cannot split it over "
            f"{tp} ranks; use a TP size that divides it"
        )

    why = unmodelled_size(profile, tp) if profile is not None else None
    if why:
        raise AlignmentError(f"{where} {tp}: {why}; use a size the profile models")


def head_option(regions: tuple[str, ...], head_dtype: str) -> dict[str, str]:
    """The ``head_dtype`` keyword for a recompute with ``regions``: only with ``lm_head``, the region it sets (a
    setting whose region is off is refused)."""
    return {"head_dtype": head_dtype} if "lm_head" in regions else {}


def check_context(config: Any, model_dir: Path, prompts: list[list[int]], max_tokens: int) -> None:
    """Refuse (before the engine starts) ``--max-tokens`` that with the longest prompt overflows the context."""
    ctx = getattr(config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if ctx is None or longest + max_tokens <= ctx:
        return
    room = ctx - longest
    fix = f"use --max-tokens {room} or less" if room >= 1 else "use a model with a longer context"
    raise AlignmentError(
        f"--max-tokens {max_tokens} plus the longest prompt ({longest} tokens) is {longest + max_tokens} "
        f"tokens, more than the model's context of {ctx} (max_position_embeddings in {model_dir}); {fix}"
    )


def load_hf(model_dir: Path) -> Any:
    """The HF model in bf16 with sdpa attention, as a trainer recomputes log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    return model


def response_logprobs(logits: Any, ids: Any, n_prompt: int, temperature: float = 1.0) -> Any:
    """fp32 log-probs of the response tokens from ``[T, V]`` logits of ``prompt + response``.

    ``temperature`` != 1: the logits are divided by it first, as vLLM's processed log-probs are
    (``logits.float().div_(temp[:, None])``, a true fp32 division, then the log-softmax).
    """
    import torch

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / torch.full((1, 1), temperature, dtype=torch.float32)
    logp = logits.log_softmax(-1)  # fp32 log-softmax, as the engine's sampler computes it
    return logp[n_prompt - 1 : -1].gather(-1, ids[n_prompt:, None])[:, 0]


def recompute(forward: Any, rollouts: list, desc: str, temperature: float = 1.0) -> list:
    """Log-probs of every rollout's response under ``forward(ids [T]) -> logits [T, V]`` (``temperature``:
    :attr:`Sample.temperature`)."""
    import torch
    from tqdm.auto import tqdm

    out = []
    with torch.no_grad():
        for r in tqdm(rollouts, desc=desc, leave=False, file=sys.stderr):
            ids = torch.tensor(r.prompt_ids + r.response_ids)
            out.append(response_logprobs(forward(ids), ids, len(r.prompt_ids), temperature))
    return out


def measure(train: list, s: Sample, seed: int) -> tuple[dict[str, Any], list[float]]:
    """Mismatch metrics (with 95% intervals under ``ci95``) and the per-token |Δlogp| list."""
    import torch

    from rlalign_verl.measure.doctor import signatures
    from rlalign_verl.measure.metrics import compute_mismatch_metrics

    rollouts = s.rollouts
    n = max(len(r.response_ids) for r in rollouts)
    t, e = torch.zeros(len(rollouts), n), torch.zeros(len(rollouts), n)
    mask = torch.zeros(len(rollouts), n, dtype=torch.bool)
    for i, (lp, r) in enumerate(zip(train, rollouts, strict=True)):
        k = len(r.response_ids)
        t[i, :k], e[i, :k], mask[i, :k] = lp, torch.tensor(r.response_logprobs), True
    metrics: dict[str, Any] = compute_mismatch_metrics(t, e, mask)
    metrics.update(signatures(t, e, mask, seed=seed))  # mismatch/doctor/*: is the gap rounding's?
    metrics["ci95"] = intervals(train, rollouts, prompt_groups(rollouts), seed=seed)
    return metrics, (t - e).abs()[mask].tolist()


def recompute_settings(
    hf: Any,
    s: Sample,
    settings: list,
    seed: int,
    note: str = "",
    flips: Any = None,
    head_dtype: str = "model",
) -> dict[str, Any]:
    """``{label: (metrics, per_token)}`` for each ``(label, regions)`` setting, aligned with the profile.

    ``flips`` (:class:`.moe_routes.RouteFlips`, MoE models) adds the routing-flip fractions to the metrics.
    ``head_dtype``: the engine's head dtype (:mod:`.head`), what the ``lm_head`` region is aligned to.
    """
    import contextlib

    from rlalign_verl.align.patch import apply_alignment, remove_alignment

    out = {}
    for label, regions in settings:
        apply_alignment(
            hf, regions=regions, engine=s.profile.name, rollout_tp=s.tp, **head_option(regions, head_dtype)
        )
        route_info: dict[str, Any] = {}
        try:
            with flips.recording(hf, route_info) if flips else contextlib.nullcontext():
                lps = recompute(
                    lambda ids: hf(input_ids=ids[None]).logits[0],
                    s.rollouts,
                    f"recompute [{label}]{note}",
                    s.temperature,
                )
        finally:
            remove_alignment(hf)
        metrics, per_token = measure(lps, s, seed)
        metrics["ci95"].update(route_info.pop("ci95", {}))  # the flip fraction's interval joins the row's
        metrics.update(route_info, regions=list(regions))
        out[label] = (metrics, per_token)
    return out


def floor(
    hf: Any, s: Sample, dist: tuple[str, str] | None, seed: int, timing: dict
) -> tuple[Any, str | None]:
    """The floor: the regions computed by the engine's own ops inside the HF model (or why it is skipped)."""
    if dist is None:
        return None, "floor skipped: vLLM is not installed here (the floor runs the engine's own ops)"
    p = s.profile
    if p.engine != "vllm" or p.device != "cpu":
        return None, (
            f"floor skipped: the rollouts come from {p.name} ({p.engine} on {p.device}); "
            "the floor needs that engine's ops on this machine"
        )
    from rlalign_verl.catalog.profiles_tp import unmodelled_size

    why = unmodelled_size(p, s.tp)
    if why:
        return None, f"floor skipped: {why}"
    from rlalign_verl.tools.diagnose.engine_floor import EngineFloor

    compiled = not p.name.endswith("-eager")
    t = time.time()
    fl = EngineFloor(hf, compiled=compiled, tp=s.tp)  # TP-aware: the all-reduce is the engine's rounding too
    what = "compiled with Inductor as the engine" if compiled else "eager"
    what += f", tensor parallel {s.tp}" if s.tp > 1 else ""
    lps = recompute(fl.logits, s.rollouts, f"floor [engine ops, {what}]", s.temperature)
    timing["floor_s"] = time.time() - t
    metrics, per_token = measure(lps, s, seed)
    metrics["compiled"] = compiled
    return (metrics, per_token), None


def probe(hf: Any, dist: tuple[str, str] | None, seed: int, timing: dict) -> dict[str, Any]:
    """The op probe (:func:`.probe.op_probe`), or why it is skipped."""
    if dist is None:
        return {"skipped": "vLLM is not installed here: the probe needs the engine's own ops"}
    from rlalign_verl.tools.diagnose.probe import op_probe

    t = time.time()
    with stage("op probe (engine ops vs region functions)"):
        result = op_probe(hf, seed=seed)
    timing["probe_s"] = time.time() - t
    return result
