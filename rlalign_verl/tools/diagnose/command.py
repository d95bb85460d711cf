"""``rlalign-verl diagnose``: measure, against a real inference engine, what each aligned region buys.

1. Rollouts: sampled by the real vLLM engine installed here (bf16, seeded, engine log-probs of every
   sampled token), or read from a dump produced elsewhere (``--rollout-logprobs``).
2. Training side: HF transformers in bf16 (sdpa) recomputes the log-probs of the sampled tokens for
   every setting (no alignment, each region alone, all regions, ...) with the engine's profile, plus
   the **floor**: the three regions executed by the engine's own ops inside the HF model (compiled
   as the engine compiles them on the compiled path). What is left at the floor comes from matmuls,
   attention, lm_head and log-softmax, which no region alignment touches.
3. Op probe: each region function vs the engine's own op on random inputs of the model's shapes:
   bit-identical fraction and max ULP per region and profile; the best-matching profile is recommended.
4. Terminal table with 95% intervals, JSON with everything, PNG plots, and a recommendation line.

The steps live in :mod:`.pipeline`, the statistics in :mod:`.stats`, the rule in :mod:`.recommend`, the
output in :mod:`.render`. See docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import AlignmentError, one_line
from rlalign_verl.base.files import check_file_target, prepare_out_dir, write_text
from rlalign_verl.catalog.families import get_family
from rlalign_verl.tools.diagnose import pipeline
from rlalign_verl.tools.diagnose.head import sample_head_dtype
from rlalign_verl.tools.diagnose.interrupt import Interrupted, signals_as_interrupts
from rlalign_verl.tools.diagnose.ladder import run_ladder
from rlalign_verl.tools.diagnose.options import DEFAULT_SETTINGS, DiagnoseOptions, parse_settings
from rlalign_verl.tools.diagnose.progress import stage
from rlalign_verl.tools.diagnose.recommend import extra_settings, recommend
from rlalign_verl.tools.diagnose.render import PLOTS, format_report, write_plots
from rlalign_verl.tools.diagnose.tiny import TINY_ARCHS

OUTPUTS = ("diagnose.json", *PLOTS, "engine.log", "rollouts.jsonl")
"""The files a run may write into ``--out`` (the rollouts when ``--write-rollouts`` names no other file)."""


def outputs(opts: DiagnoseOptions) -> tuple[str, ...]:
    """The files of :data:`OUTPUTS` this run writes into ``--out``."""
    skip = set() if opts.plots else set(PLOTS)
    if opts.rollout_logprobs:  # no engine runs here
        skip |= {"engine.log", "rollouts.jsonl"}
    elif opts.write_rollouts:
        skip.add("rollouts.jsonl")
    return tuple(n for n in OUTPUTS if n not in skip)


def _add_source_args(p: argparse.ArgumentParser) -> None:
    """Where the model and the rollouts come from."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="HF checkpoint directory (Qwen2/Qwen2.5, Qwen3, Llama)")
    src.add_argument(
        "--tiny",
        choices=TINY_ARCHS,
        default=None,
        help="built-in tiny model (default: qwen2)",
    )
    p.add_argument(
        "--engine",
        metavar="PROFILE",
        default=None,
        help="engine profile of the rollouts (default: vllm-cpu here, or the dump's profile); "
        "vllm-cpu-eager runs the engine with enforce_eager=True",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="prompts to sample (default: 32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per prompt (default: 32)")
    p.add_argument("--rollout-logprobs", metavar="DUMP", help="read engine rollouts from this JSONL dump")
    p.add_argument(
        "--write-rollouts", metavar="OUT", help="also write the engine rollouts to this JSONL dump"
    )


def add_parser(subparsers: Any) -> None:
    """Register ``diagnose`` on the ``rlalign-verl`` sub-command parser."""
    p = subparsers.add_parser(
        "diagnose",
        help="measure train-vs-rollout log-prob gaps per aligned region against a real engine",
        description=(
            "Sample with the installed inference engine (or read a rollout dump), recompute the log-probs "
            "with HF transformers for each alignment setting and the engine-op floor, and report what each "
            "region buys. Default: a tiny local Qwen2 and the installed vLLM engine."
        ),
    )
    _add_source_args(p)
    p.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="comma-separated alignment settings: none, all, a region (rope, swiglu, rmsnorm; opt-in: "
        "attention, lm_head, moe, tp) or regions joined with '+' (e.g. rope+rmsnorm, all+attention); "
        "default: none,rope,swiglu,rmsnorm,all",
    )
    p.add_argument(
        "--out",
        default="rlalign-diagnose",
        metavar="DIR",
        help="output directory (default: ./rlalign-diagnose)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="samples per prompt, pooled (independent per-request seeds); the 95%% intervals resample "
        "prompts (default: 1)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the HF recomputation (default: 1 for models with hidden size <= 1024, "
        "where more threads only add synchronisation, else torch's default)",
    )
    p.add_argument(
        "--engine-head-dtype",
        metavar="DTYPE",
        default=None,
        help="the engine's lm_head dtype: float32 runs vLLM with hf_overrides head_dtype=float32 (the log-probs "
        "compared are then the fp32-head ones) and aligns the lm_head rung to it; model = bf16 (default)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="run the engine at tensor parallel N (vLLM's multiprocessing executor, this machine's CPUs split "
        "between the ranks); the ladder's '+ tp' rung and the floor mirror its all-reduce. With "
        "--rollout-logprobs the dump header's tensor_parallel_size is used (default: 1)",
    )
    p.add_argument("--no-ladder", action="store_true", help="skip the attribution ladder")
    p.add_argument("--no-floor", action="store_true", help="skip the engine-op floor")
    p.add_argument("--no-probe", action="store_true", help="skip the op-level probe")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (2 with a one-line error for bad input; 130 / 143 with one
    line when SIGINT / SIGTERM stopped it, the engine child and its temporary files gone)."""
    try:
        with signals_as_interrupts():
            result = diagnose(DiagnoseOptions.from_args(args))
            print(format_report(result))
            paths = result["paths"]
            print(f"\nwrote {paths['json']}" + "".join(f", {p}" for p in paths.get("plots", [])))
    except AlignmentError as e:
        print(one_line(e), file=sys.stderr)
        return 2
    except Interrupted as e:
        print(
            f"[rlalign-verl] interrupted by {e.name}: stopped the run and any engine child, removed their "
            f"temporary files; what {getattr(args, 'out', 'the output directory')} holds is incomplete, rerun "
            "the command",
            file=sys.stderr,
        )
        return e.exit_status
    return 0


def diagnose(opts: DiagnoseOptions | None = None, **kwargs: Any) -> dict[str, Any]:
    """The whole diagnosis; returns the result dict that is also written to ``<out>/diagnose.json``.

    ``kwargs`` override fields of ``opts`` (``diagnose(num_prompts=4)``).
    """
    opts = replace(opts or DiagnoseOptions(), **kwargs)
    opts.check()  # bad options fail in one line before torch is even imported
    import torch

    before = torch.get_num_threads()
    try:
        return _diagnose(opts)
    finally:
        torch.set_num_threads(before)


def _sample(opts: DiagnoseOptions, dist: Any, out_dir: Path, timing: dict, settings: list) -> pipeline.Sample:
    from rlalign_verl.tools.diagnose.runner import INSTALL_HINT, EngineUnavailableError

    if opts.rollout_logprobs:
        return pipeline.sample_from_dump(opts, settings)
    if dist is None:
        raise EngineUnavailableError(
            f"no inference engine installed here (`import vllm` fails). To fix: {INSTALL_HINT}"
        )
    return pipeline.sample_with_engine(opts, dist, out_dir, timing, settings)


def _settings(
    hf: Any, s: pipeline.Sample, opts: DiagnoseOptions, settings: list, timing: dict, head: str
) -> tuple:
    flips = None
    if get_family(s.config.model_type).experts is not None:  # MoE: route flips, the opt-in moe region
        from rlalign_verl.tools.diagnose.moe_routes import RouteFlips
        from rlalign_verl.tools.diagnose.runner import engine_distribution

        if opts.settings == DEFAULT_SETTINGS:
            # at rollout TP > 1 the engine splits each expert over the ranks: the moe rows need tp to mirror it
            moe_rows = "moe,all+moe" if s.tp == 1 else "moe+tp,all+moe+tp"
            settings = settings + [x for x in parse_settings(moe_rows) if x not in settings]
        t = time.time()
        with stage("record the engine's expert choices (one prefill per rollout)"):
            flips = RouteFlips.maybe(
                s.config, s.model_dir, s.rollouts, s.profile, engine_distribution(), seed=opts.seed
            )
        timing["engine_routes_s"] = time.time() - t
    t = time.time()
    done = pipeline.recompute_settings(hf, s, settings, opts.seed, flips=flips, head_dtype=head)
    timing["recompute_s"] = time.time() - t
    results = {lab: m for lab, (m, _) in done.items()}
    per_token = {lab: pt for lab, (_, pt) in done.items()}
    extra = pipeline.recompute_settings(
        hf,
        s,
        extra_settings(results, settings, s.prompts),
        opts.seed,
        " (for the recommendation)",
        flips,
        head,
    )
    for lab, (m, pt) in extra.items():
        results[lab], per_token[lab] = {**m, "extra": True}, pt
    return results, per_token


def _diagnose(opts: DiagnoseOptions) -> dict[str, Any]:
    import torch

    from rlalign_verl.tools.diagnose.runner import engine_distribution

    t_start, timing = time.time(), {}
    settings = opts.check()
    out_dir = prepare_out_dir(
        opts.out, names=outputs(opts)
    )  # a link or a directory there is refused up front
    if opts.write_rollouts:
        check_file_target(opts.write_rollouts, "--write-rollouts")
    dist = engine_distribution()
    s = _sample(opts, dist, out_dir, timing, settings)  # the settings are checked before the engine starts
    head = sample_head_dtype(s.header, s.config, opts.engine_head_dtype, s.source)
    threads = opts.threads or (1 if s.config.hidden_size <= 1024 else torch.get_num_threads())
    torch.set_num_threads(max(1, threads))
    t = time.time()
    hf = pipeline.load_hf(s.model_dir)
    timing["hf_load_s"] = time.time() - t
    results, per_token = _settings(hf, s, opts, settings, timing, head[0])
    ladder_result = None
    if opts.ladder:
        t = time.time()
        ladder_result = run_ladder(hf, s, head, opts.seed, per_token)
        timing["ladder_s"] = time.time() - t
    floor_result, floor_note = pipeline.floor(hf, s, dist, opts.seed, timing) if opts.floor else (None, None)
    if floor_result is not None:
        floor_result, per_token["floor"] = floor_result
    probe_result = pipeline.probe(hf, dist, opts.seed, timing) if opts.probe else None
    timing["total_s"] = time.time() - t_start
    result = _result(opts, s, dist, results, floor_result, floor_note, probe_result)
    result["engine"]["head_dtype"] = head[0]
    result["ladder"] = ladder_result
    result["doctor"] = doctor_lines(results)
    result.update(
        timing={k: round(v, 2) for k, v in timing.items()}, threads=threads, per_token_abs_diff=per_token
    )
    json_path = out_dir / "diagnose.json"
    write_text(json_path, json.dumps(result, indent=1, default=_json_default) + "\n")
    paths: dict[str, Any] = {"json": str(json_path)}
    if opts.plots:
        paths["plots"] = write_plots(result, out_dir)
    result["paths"] = paths
    return result


def doctor_lines(results: dict[str, Any]) -> dict[str, list[str]]:
    """Per setting (none, all): the doctor's lines for causes that are not rounding ([] = rounding's signature)."""
    from rlalign_verl.measure.doctor import diagnose_signature

    return {label: diagnose_signature(results[label]) for label in ("none", "all") if label in results}


def _result(opts, s, dist, results, floor_result, floor_note, probe_result) -> dict[str, Any]:
    h, c = s.header, s.config
    return {
        "engine": {
            "name": h.engine,
            "version": h.engine_version,
            "mode": h.mode,
            "profile": s.profile.name,
            "compilation": h.compilation,
            "device": h.device,
            "tensor_parallel_size": h.tensor_parallel_size,
            "logprobs_mode": h.logprobs_mode,
            "logprob_temperature": s.temperature,
            "extra": h.extra,
            "source": s.source,
            "rollouts": str(s.dump_path),
            "installed": {"name": dist[0], "version": dist[1]} if dist else None,
        },
        "model": {
            "path": str(s.model_dir),
            "model_type": c.model_type,
            "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers,
            "vocab_size": c.vocab_size,
            "tiny": None if opts.model else (opts.tiny or "qwen2"),
        },
        "sampling": {
            **h.sampling,
            "seed": h.seed,
            "num_prompts": len(s.rollouts) // opts.seeds,
            "seeds": opts.seeds,
        },
        "settings": results,
        "floor": floor_result,
        "floor_note": floor_note,
        "op_probe": probe_result,
        "recommendation": recommend(results, floor_result, s.tp, prompts=s.prompts),
    }


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)
