"""The cost of alignment: aligned vs unaligned HF Qwen2-style models, time and peak memory.

Run: ``python benchmarks/overhead.py [--quick] [--json overhead.json] [--repeat 5] [--device cpu|cuda]``.

Models are built locally from a ``Qwen2Config`` (random init, nothing downloaded). For every setting
(model size x parameter dtype x input layout x mode) the *same* model instance is switched between
variants with :func:`rlalign_verl.align.patch.apply_alignment` / :func:`~rlalign_verl.align.patch.remove_alignment`,
and the variants are timed **interleaved** (one step of each variant per round, the order rotated
every round, warm-up rounds first); the reported time is the median over the rounds.

Variants: ``hf`` (unaligned), ``<profile>:<region>`` (one region) and ``<profile>:all``. Modes:
``train`` (forward + log-prob loss + backward), ``train-gc`` (the same with HF gradient checkpointing,
``use_reentrant=False`` as verl sets it), ``logprob`` (forward under ``no_grad``: verl's old/ref log-probs).
Parameter dtypes: ``bf16`` (what FSDP's ``param_dtype=bf16`` computes with) and ``fp32+autocast``
(fp32 parameters under ``torch.autocast(bf16)``). Layouts: ``padded`` (batch with right padding and an
attention mask) and ``packed`` (batch 1, ``position_ids`` restarting per sequence, no mask).

Memory (untimed pass per variant): peak bytes allocated by torch during one step above what was
allocated before it (activations, temporaries and parameter gradients), plus the step's total peak
(parameters included, what ``torch.cuda.max_memory_allocated`` reports). CPU: taken from the torch
profiler's allocator records (every CPU allocation and free torch makes, with its size and time),
summed in time order; CUDA: ``torch.cuda.max_memory_allocated``. Also the bytes the training forward
leaves allocated when it returns ("held": everything kept for backward, plus the log-probs), which with
gradient checkpointing is mostly the layer inputs the checkpoints keep.

``--quick`` is a CI smoke run (< 60 s on 2 cores); it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch
from overhead_micro import format_micro, run_micro  # sibling modules (run as `python benchmarks/overhead.py`)
from overhead_model import build_model
from overhead_plan import SIZES, plan
from overhead_report import format_table, machine_info
from overhead_setting import Result, run_setting


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: ``--quick``, ``--micro`` and what selects sizes, profiles, rounds and the device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: one tiny model, 3 rounds")
    parser.add_argument("--json", default="overhead.json", help="where to write the results (JSON)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 5; quick 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads (default 1: on a shared machine OpenMP threads spin-wait and times become noise)",
    )  # fmt: skip
    parser.add_argument(
        "--profiles", default="vllm,sglang,vllm-eager",
        help="comma-separated engine profiles; the first two also get each region alone",
    )  # fmt: skip
    parser.add_argument(
        "--sizes", default=None,
        help=f"comma-separated model sizes for the full run (first gets the whole matrix): {', '.join(SIZES)}",
    )  # fmt: skip
    parser.add_argument(
        "--micro", action="store_true", help="per-region forward+backward micro-benchmark instead"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="--micro without the torch.compile variants"
    )
    return parser.parse_args(argv)


def micro_main(args: argparse.Namespace, profiles: list[str], repeat: int) -> None:
    """``--micro``: one layer's regions at 2048 tokens, H 1024, I 2816; prints the rows, writes the JSON."""
    rows = run_micro(profiles, 2048, 1024, 2816, repeat, compiled=not args.no_compile)
    print(format_micro(rows))
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(args.device), "micro": rows}, f, indent=1)


def model_main(args: argparse.Namespace, profiles: list[str], repeat: int) -> None:
    """The model-level run: every planned setting, one model per (size, dtype); prints rows as they finish."""
    sizes = [SIZES[n.strip()] for n in args.sizes.split(",")] if args.sizes else None
    settings = plan(args.quick, profiles, sizes)
    info = machine_info(args.device)
    info["load_avg_start"] = os.getloadavg()
    print(f"torch {info['torch']} on {info['cpu_model']} ({info['threads']} threads), device {args.device}")
    t_start = time.perf_counter()
    results: list[Result] = []
    models: dict[tuple[str, str], torch.nn.Module] = {}
    for s in settings:
        key = (s.size.name, s.dtype)
        if key not in models:
            models.clear()
            models[key] = build_model(
                s.size, torch.bfloat16 if s.dtype == "bf16" else torch.float32, args.device
            )
        rows = run_setting(models[key], s.size, s.dtype, s.layout, s.mode, list(s.variants), repeat,
                           args.warmup, args.device)  # fmt: skip
        results += rows
        print(
            format_table(rows).split("\n", 2)[2] if len(results) > len(rows) else format_table(rows),
            flush=True,
        )
    info["load_avg_end"] = os.getloadavg()
    info["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(args.json, "w") as f:
        json.dump({"machine": info, "repeat": repeat, "warmup": args.warmup, "quick": args.quick,
                   "results": [asdict(r) for r in results]}, f, indent=1)  # fmt: skip
    print(f"wrote {args.json} ({len(results)} rows) in {info['wall_s']} s; load avg {info['load_avg_end']}")


def main(argv: list[str] | None = None) -> int:
    """Run the model-level benchmark (or ``--micro``) and write its JSON."""
    args = parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 5)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    (micro_main if args.micro else model_main)(args, profiles, repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
