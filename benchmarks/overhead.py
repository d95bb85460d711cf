"""The cost of alignment: aligned vs unaligned HF Qwen2-style models, time and peak memory.

Run: ``python benchmarks/overhead.py [--quick] [--json overhead.json] [--repeat 5] [--device cpu|cuda]``.

Models are built locally from a ``Qwen2Config`` (random init, nothing downloaded). For every setting
(model size x parameter dtype x input layout x mode) the *same* model instance is switched between
variants with :func:`rlalign_verl.patch.apply_alignment` / :func:`~rlalign_verl.patch.remove_alignment`,
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
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from saved_bytes import saved_bytes  # the sibling module (run as `python benchmarks/overhead.py`)

from rlalign_verl.patch import apply_alignment, remove_alignment

MODES = ("train", "train-gc", "logprob")
DTYPES = ("bf16", "fp32+autocast")
LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Size:
    """One model shape and the tokens fed to it (``batch`` sequences of up to ``seq`` tokens)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    vocab: int = 4096


@dataclass(frozen=True)
class Variant:
    """``hf`` (unaligned) or one profile with some regions."""

    name: str
    profile: str | None = None
    regions: tuple[str, ...] = ()


@dataclass
class Result:
    size: str
    dtype: str
    layout: str
    mode: str
    variant: str
    profile: str | None
    regions: list[str]
    tokens: int
    times_ms: list[float] = field(default_factory=list)
    cpu_times_ms: list[float] = field(default_factory=list)
    median_ms: float = 0.0
    median_cpu_ms: float = 0.0
    time_ratio: float = 1.0
    wall_ratio: float = 1.0
    step_peak_bytes: int = 0
    step_peak_ratio: float = 1.0
    total_peak_bytes: int = 0
    total_peak_ratio: float = 1.0
    held_bytes: int = 0
    held_ratio: float = 1.0


def variants_for(profiles: list[str], per_region: list[str]) -> list[Variant]:
    """``hf``, each region alone for the ``per_region`` profiles, and all regions for every profile."""
    out = [Variant("hf")]
    for p in profiles:
        if p in per_region:
            out += [Variant(f"{p}:{r}", p, (r,)) for r in ("rope", "swiglu", "rmsnorm")]
        out.append(Variant(f"{p}:all", p, ("rope", "swiglu", "rmsnorm")))
    return out


def build_model(size: Size, param_dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """A Qwen2-style causal LM of ``size`` with the tiny checkpoints' seeded weights (norm weights around 1)."""
    from rlalign_verl.diagnose.tiny import TinySpec, tiny_model

    spec = TinySpec("qwen2", size.hidden, size.intermediate, size.layers, size.heads, size.kv_heads,
                    size.hidden // size.heads, rope_theta=1_000_000.0, max_position_embeddings=max(4096, size.seq),
                    weight_std=0.05, embed_std=0.05, lm_head_std=0.05)  # fmt: skip
    return tiny_model(spec, vocab_size=size.vocab, seed=seed, dtype=param_dtype).to(device)


def make_inputs(size: Size, layout: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, labels, a loss mask and either an attention mask (padded) or restarting position_ids (packed).

    Both layouts hold the same sequence lengths (between half and all of ``seq``).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(size.seq // 2, size.seq + 1, (size.batch,), generator=g)
    lengths[0] = size.seq
    if layout == "padded":
        ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)
        mask = (torch.arange(size.seq)[None, :] < lengths[:, None]).long()
        inputs = {"input_ids": ids, "attention_mask": mask}
        loss_mask = mask
    elif layout == "packed":
        total = int(lengths.sum())
        ids = torch.randint(0, size.vocab, (1, total), generator=g)
        pos = torch.cat([torch.arange(int(n)) for n in lengths])[None, :]
        inputs = {"input_ids": ids, "position_ids": pos}
        loss_mask = torch.ones(1, total, dtype=torch.long)
    else:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    labels = torch.roll(inputs["input_ids"], -1, dims=1)
    out = {**inputs, "labels": labels, "loss_mask": loss_mask}
    return {k: v.to(device) for k, v in out.items()}


def log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the labels, fp32 (as verl's ``logprobs_from_logits``)."""
    kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**kwargs, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def step_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor], mode: str, autocast: bool) -> Callable[[], None]:
    """One measured step: train (forward + loss + backward, gradients freed first) or no-grad log-probs."""
    device_type = next(model.parameters()).device.type
    amp = (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if autocast else nullcontext
    mask = batch["loss_mask"].float()

    def train() -> None:
        model.zero_grad(set_to_none=True)
        with amp():
            lp = log_probs(model, batch)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()

    def logprob() -> None:
        with torch.no_grad(), amp():
            log_probs(model, batch)

    return logprob if mode == "logprob" else train


def forward_only(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: bool) -> torch.Tensor:
    """The training forward without backward: its result keeps every tensor saved for backward alive."""
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16) if autocast else nullcontext():
        return log_probs(model, batch)


def set_mode(model: torch.nn.Module, mode: str) -> None:
    if mode == "train-gc":
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
        model.train(mode == "train")


def set_variant(model: torch.nn.Module, v: Variant) -> None:
    remove_alignment(model)
    if v.profile is not None:
        apply_alignment(model, regions=v.regions, engine=v.profile)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory(fn: Callable[[], object], device: str) -> tuple[int, int]:
    """(peak bytes torch allocates during ``fn`` above those allocated before it, bytes still held by
    what ``fn`` returns once it has returned)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        del out
        return torch.cuda.max_memory_allocated() - base, held
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in records:
        if e.device_type() == torch._C._autograd.DeviceType.CPU:
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak, cur


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def run_setting(
    model: torch.nn.Module,
    size: Size,
    dtype: str,
    layout: str,
    mode: str,
    variants: list[Variant],
    repeat: int,
    warmup: int,
    device: str,
) -> list[Result]:
    """Time (interleaved) and measure memory of every variant on one model, one input, one mode."""
    batch = make_inputs(size, layout, device)
    set_mode(model, mode)
    fn = step_fn(model, batch, mode, autocast=dtype == "fp32+autocast")
    tokens = int(batch["loss_mask"].sum())
    results = [
        Result(size.name, dtype, layout, mode, v.name, v.profile, list(v.regions), tokens) for v in variants
    ]
    n = len(variants)
    for rnd in range(warmup + repeat):
        for j in range(n):
            i = (j + rnd) % n  # rotate the order every round
            set_variant(model, variants[i])
            sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            sync(device)
            if rnd >= warmup:
                results[i].times_ms.append((time.perf_counter() - t0) * 1e3)
                results[i].cpu_times_ms.append((time.thread_time() - c0) * 1e3)
    weights = param_bytes(model)
    for v, r in zip(variants, results, strict=True):
        set_variant(model, v)
        # free the gradients before the profiler starts: it records the free of a block it saw allocated
        # (in an earlier profiled step) but not of one allocated before, which would skew the sum
        model.zero_grad(set_to_none=True)
        r.median_ms = statistics.median(r.times_ms)
        r.median_cpu_ms = statistics.median(r.cpu_times_ms)
        r.step_peak_bytes, _ = peak_memory(fn, device)
        # total = weights + the step's peak above them (gradients are freed before each step, as
        # zero_grad(set_to_none=True) does, so they are part of the step's peak)
        r.total_peak_bytes = weights + r.step_peak_bytes
        if mode != "logprob":  # what the forward keeps alive for backward (the graph + its output)
            _, r.held_bytes = peak_memory(lambda: forward_only(model, batch, dtype == "fp32+autocast"), device)
    remove_alignment(model)
    base = results[0]
    for r in results:
        r.wall_ratio = r.median_ms / base.median_ms
        # CPU: this thread's CPU time (one intra-op thread), which other processes on a shared machine
        # disturb far less than wall time; CUDA: wall time (the host thread waits in synchronize)
        r.time_ratio = r.median_cpu_ms / base.median_cpu_ms if device == "cpu" else r.wall_ratio
        r.step_peak_ratio = r.step_peak_bytes / max(base.step_peak_bytes, 1)
        r.total_peak_ratio = r.total_peak_bytes / max(base.total_peak_bytes, 1)
        r.held_ratio = r.held_bytes / base.held_bytes if base.held_bytes else 1.0
    return results


# --- plans --------------------------------------------------------------------------------------

QUICK_SIZES = [Size("h256-L2", 256, 704, 2, 4, 2, seq=128, batch=2, vocab=1024)]
FULL_SIZES = [
    Size("h512-L4", 512, 1408, 4, 8, 2, seq=256, batch=2),
    Size("h1024-L4", 1024, 2816, 4, 16, 4, seq=128, batch=2),
]
GPU_SIZES = [
    Size("h1024-L8", 1024, 2816, 8, 16, 4, seq=1024, batch=4),
    Size("h2048-L8", 2048, 5632, 8, 16, 4, seq=2048, batch=2),
]
"""Too slow for a 2-core CPU in 5 minutes; select them with ``--sizes`` on a GPU."""
SIZES = {s.name: s for s in QUICK_SIZES + FULL_SIZES + GPU_SIZES}


@dataclass(frozen=True)
class Setting:
    size: Size
    dtype: str
    layout: str
    mode: str
    variants: tuple[Variant, ...]


def plan(quick: bool, profiles: list[str], sizes: list[Size] | None = None) -> list[Setting]:
    """Which settings to run: bf16 padded on the first size gets each region alone for the first two
    profiles; the other settings compare ``hf`` with all regions of every profile."""
    every = tuple(variants_for(profiles, per_region=profiles[: 1 if quick else 2]))
    main = tuple(variants_for(profiles, per_region=[]))
    out: list[Setting] = []
    if quick:
        size = QUICK_SIZES[0]
        out += [Setting(size, "bf16", "padded", mode, every) for mode in MODES]
        out.append(Setting(size, "bf16", "packed", "train", main))
        out.append(Setting(size, "fp32+autocast", "padded", "train", main))
        return out
    first, *rest = sizes or FULL_SIZES
    for mode in MODES:
        out.append(Setting(first, "bf16", "padded", mode, every))
    for mode in MODES:
        out.append(Setting(first, "bf16", "packed", mode, main))
        if mode != "train-gc":  # keeps the full run under 5 minutes on 2 shared cores
            out.append(Setting(first, "fp32+autocast", "padded", mode, main))
    for size in rest:
        for mode in ("train", "train-gc", "logprob"):
            out.append(Setting(size, "bf16", "padded", mode, main))
    return out


# --- per-region micro-benchmark: HF's ops vs the aligned region vs its compiled variant --------------


def _hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    v = x.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return w * v.to(x.dtype)


def micro_cases(profile: str, tokens: int, hidden: int, inter: int, compiled: bool) -> dict[str, dict]:
    """``region -> {variant: (fn, inputs)}`` at one layer's shapes; each fn runs forward and backward."""
    import torch.nn.functional as F
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from rlalign_verl.profiles import get_profile
    from rlalign_verl.regions.rmsnorm import add_rms_norm
    from rlalign_verl.regions.rope import apply_rope, rope_table
    from rlalign_verl.regions.swiglu import swiglu

    p = get_profile(profile)
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int, scale: float = 1.0, dtype: torch.dtype = bf) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(True)

    def fwd_bwd(fn: Callable[..., object], *xs: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            out = fn(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])

        run.forward, run.inputs = (lambda: fn(*xs)), xs  # type: ignore[attr-defined]  # for saved_bytes
        return run

    gate, up = leaf(tokens, inter, scale=3.0), leaf(tokens, inter)
    h, w = leaf(tokens, hidden), leaf(hidden)
    res = leaf(tokens, hidden, scale=4.0, dtype=torch.float32 if p.residual.value == "at_attention" else bf)
    heads, kv, hd = hidden // 64, max(1, hidden // 256), 64
    q = leaf(1, tokens, heads, hd).transpose(1, 2)
    k = leaf(1, tokens, kv, hd).transpose(1, 2)
    cos32, sin32 = rope_table(1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd)), torch.arange(tokens)[None])
    cos, sin = cos32.to(bf), sin32.to(bf)
    tcos, tsin = (cos32, sin32) if p.rope.table == "fp32" else (cos, sin)
    hres = res.detach().to(bf).requires_grad_(True)
    cases: dict[str, dict] = {
        "swiglu": {
            "hf": fwd_bwd(lambda a, b: F.silu(a) * b, gate, up),
            "aligned": fwd_bwd(lambda a, b: swiglu(a, b, p.swiglu), gate, up),
        },
        "add+rmsnorm": {
            "hf": fwd_bwd(lambda a, r, ww: (lambda s: (_hf_rmsnorm(s, ww, 1e-6), s))(r + a), h, hres, w),
            "aligned": fwd_bwd(
                lambda a, r, ww: add_rms_norm(a, r, ww, 1e-6, p.norm, round_residual=True), h, res, w
            ),
        },
        "rope": {
            "hf": fwd_bwd(lambda a, b: apply_rotary_pos_emb(a, b, cos, sin), q, k),
            "aligned": fwd_bwd(lambda a, b: apply_rope(a, b, tcos, tsin, p.rope), q, k),
        },
    }
    cases.update(_opt_in_cases(p, tokens, hidden, leaf, fwd_bwd))
    if compiled:
        from rlalign_verl.regions.compiled import compiled_regions

        c = compiled_regions(p, exact=False)
        cases["swiglu"]["compiled"] = fwd_bwd(c.swiglu, gate, up)
        cases["add+rmsnorm"]["compiled"] = fwd_bwd(
            lambda a, r, ww: c.add_rms_norm(a, r, ww, 1e-6, round_residual=True), h, res, w
        )
        cases["rope"]["compiled"] = fwd_bwd(lambda a, b: c.apply_rope(a, b, tcos, tsin), q, k)
        if p.norm_inductor:  # compiled_norm: the forward compiled as the engine compiles it (inductor_norm)
            from rlalign_verl.regions.inductor_norm import inductor_norms

            c_add = inductor_norms(p)[1]
            cases["add+rmsnorm"]["cnorm"] = fwd_bwd(
                lambda a, r, ww: c_add(a, r, ww, 1e-6, p.norm, round_residual=True, index=2), h, res, w
            )
    return cases


def _opt_in_cases(p, tokens: int, hidden: int, leaf: Callable, fwd_bwd: Callable) -> dict[str, dict]:
    """attention (vLLM CPU profiles: engine op / fp32 SDPA vs HF's bf16 SDPA) and lm_head (fp32 head vs bf16)."""
    import torch.nn.functional as F

    from rlalign_verl.regions.attention import aligned_attention, engine_op_available
    from rlalign_verl.regions.lm_head import Fp32HeadFn

    vocab = 32 * hidden
    hh, wh = leaf(tokens, hidden), leaf(vocab, hidden, scale=0.05)
    cases: dict[str, dict] = {"lm_head": {
        "hf": fwd_bwd(lambda a, ww: F.linear(a, ww), hh, wh),
        "aligned": fwd_bwd(lambda a, ww: Fp32HeadFn.apply(a, ww, None, p.device == "cuda"), hh, wh),
    }}  # fmt: skip
    if p.engine != "vllm" or p.device != "cpu":
        return cases
    heads, kv, hd = hidden // 64, max(1, hidden // 256), 64
    q, k, v = leaf(1, heads, tokens, hd), leaf(1, kv, tokens, hd), leaf(1, kv, tokens, hd)
    pos = torch.arange(tokens)[None]

    def hf(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

    cases["attention"] = {"hf": fwd_bwd(hf, q, k, v)}
    if engine_op_available()[0]:
        cases["attention"]["aligned"] = fwd_bwd(lambda a, b, c: aligned_attention(a, b, c, pos, None), q, k, v)
    cases["attention"]["sdpa-fp32"] = fwd_bwd(lambda a, b, c: aligned_attention(a, b, c, pos, None, "sdpa-fp32"), q, k, v)
    return cases


def run_micro(profiles: list[str], tokens: int, hidden: int, inter: int, repeat: int, compiled: bool) -> list[dict]:
    rows = []
    for profile in profiles:
        for region, variants in micro_cases(profile, tokens, hidden, inter, compiled).items():
            names = list(variants)
            times: dict[str, list[float]] = {n: [] for n in names}
            for rnd in range(2 + repeat):  # two warm-up rounds (compilation happens in the first)
                for j in range(len(names)):
                    n = names[(j + rnd) % len(names)]
                    t0 = time.thread_time()  # this thread's CPU time: robust to other load on the machine
                    variants[n]()
                    if rnd >= 2:
                        times[n].append((time.thread_time() - t0) * 1e3)
            base = statistics.median(times["hf"])
            peaks = {n: peak_memory(variants[n], "cpu")[0] for n in names}
            saved = {n: saved_bytes(variants[n].forward, variants[n].inputs) for n in names}
            for n in names:
                med = statistics.median(times[n])
                rows.append({"profile": profile, "region": region, "variant": n, "median_cpu_ms": med,
                             "ratio": med / base, "peak_bytes": peaks[n], "peak_ratio": peaks[n] / peaks["hf"],
                             "saved_bytes": saved[n][0], "saved_new_bytes": saved[n][1],
                             "tokens": tokens, "hidden": hidden, "inter": inter})  # fmt: skip
    return rows


# --- output -------------------------------------------------------------------------------------


def machine_info(device: str) -> dict[str, object]:
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def format_table(results: list[Result]) -> str:
    head = (
        f"{'size':<9} {'dtype':<13} {'layout':<6} {'mode':<8} {'variant':<16} {'wall ms':>9} {'wall x':>7} "
        f"{'cpu ms':>8} {'time x':>7} "
        f"{'step MiB':>9} {'step x':>7} {'total x':>7} {'held MiB':>9} {'held x':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        held = f"{r.held_bytes / 2**20:9.1f} {r.held_ratio:7.3f}" if r.mode != "logprob" else f"{'-':>9} {'-':>7}"
        lines.append(
            f"{r.size:<9} {r.dtype:<13} {r.layout:<6} {r.mode:<8} {r.variant:<16} {r.median_ms:9.1f} "
            f"{r.wall_ratio:7.3f} {r.median_cpu_ms:8.1f} {r.time_ratio:7.3f} {r.step_peak_bytes / 2**20:9.1f} {r.step_peak_ratio:7.3f} "
            f"{r.total_peak_ratio:7.3f} {held}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--micro", action="store_true", help="per-region forward+backward micro-benchmark instead")
    parser.add_argument("--no-compile", action="store_true", help="--micro without the torch.compile variants")
    args = parser.parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 5)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    if args.micro:
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        rows = run_micro(profiles, 2048, 1024, 2816, repeat, compiled=not args.no_compile)
        print(f"{'profile':<11} {'region':<12} {'variant':<9} {'cpu ms':>9} {'x hf':>6} {'peak MiB':>9} {'x hf':>6}"
              f" {'saved MiB':>9} {'new MiB':>8}   (fwd+bwd, 2048 tokens, H 1024, I 2816; saved: for backward,"
              " new: beyond the inputs)")  # fmt: skip
        for r in rows:
            print(f"{r['profile']:<11} {r['region']:<12} {r['variant']:<9} {r['median_cpu_ms']:9.2f} {r['ratio']:6.2f} "
                  f"{r['peak_bytes'] / 2**20:9.1f} {r['peak_ratio']:6.2f} {r['saved_bytes'] / 2**20:9.1f} "
                  f"{r['saved_new_bytes'] / 2**20:8.1f}")  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(args.device), "micro": rows}, f, indent=1)
        return 0
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
        print(format_table(rows).split("\n", 2)[2] if len(results) > len(rows) else format_table(rows), flush=True)
    info["load_avg_end"] = os.getloadavg()
    info["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(args.json, "w") as f:
        json.dump({"machine": info, "repeat": repeat, "warmup": args.warmup, "quick": args.quick,
                   "results": [asdict(r) for r in results]}, f, indent=1)  # fmt: skip
    print(f"wrote {args.json} ({len(results)} rows) in {info['wall_s']} s; load avg {info['load_avg_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
