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
4. Terminal table, JSON with everything, PNG plots, and a recommendation line.

See docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AlignmentError, ProfileMismatchError, UnsupportedModelError, VocabularyMismatchError
from ..regions import REGIONS, normalize_regions

DEFAULT_SETTINGS = "none,rope,swiglu,rmsnorm,all"
KEY_METRICS = (
    ("mean", "mismatch/logp_abs_diff_mean"),
    ("p99", "mismatch/logp_abs_diff_p99"),
    ("max", "mismatch/logp_abs_diff_max"),
    ("k3 KL", "mismatch/kl_k3"),
    ("max ratio", "mismatch/ratio_max"),
)
RECOMMEND_FRACTION = 0.9


# --- command line --------------------------------------------------------------------------------


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
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="HF checkpoint directory (Qwen2/Qwen2.5, Qwen3, Llama)")
    src.add_argument(
        "--tiny",
        choices=("qwen2", "qwen3", "llama"),
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
    p.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="comma-separated alignment settings: none, all, a region (rope, swiglu, rmsnorm) or regions "
        "joined with '+' (e.g. rope+rmsnorm); default: none,rope,swiglu,rmsnorm,all",
    )
    p.add_argument(
        "--out",
        default="rlalign-diagnose",
        metavar="DIR",
        help="output directory (default: ./rlalign-diagnose)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the HF recomputation (default: 1 for models with hidden size <= 1024, "
        "where more threads only add synchronisation, else torch's default)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the engine-op floor")
    p.add_argument("--no-probe", action="store_true", help="skip the op-level probe")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (2 with a one-paragraph error for bad input)."""
    try:
        result = diagnose(
            model=args.model,
            tiny=args.tiny,
            engine=args.engine,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            rollout_logprobs=args.rollout_logprobs,
            write_rollouts=args.write_rollouts,
            settings=args.settings,
            out=args.out,
            seed=args.seed,
            temperature=args.temperature,
            floor=not args.no_floor,
            probe=not args.no_probe,
            plots=not args.no_plots,
            threads=args.threads,
        )
    except AlignmentError as e:
        print(f"rlalign-verl diagnose: error: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    print(f"\nwrote {result['paths']['json']}" + "".join(f", {p}" for p in result["paths"].get("plots", [])))
    return 0


# --- settings ------------------------------------------------------------------------------------


def parse_settings(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """``"none,rope,all,rope+swiglu"`` -> ``[(label, regions), ...]`` (deduplicated, order kept)."""
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[tuple[str, ...]] = set()
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        regions = normalize_regions(item.replace("+", ","))
        if regions in seen:
            continue
        seen.add(regions)
        out.append((_label(regions), regions))
    if not out:
        raise AlignmentError(f"--settings {text!r} names no setting; e.g. --settings {DEFAULT_SETTINGS}")
    return out


def _label(regions: tuple[str, ...]) -> str:
    if not regions:
        return "none"
    if regions == REGIONS:
        return "all"
    return "+".join(regions)


# --- progress ------------------------------------------------------------------------------------


@contextmanager
def _stage(desc: str) -> Iterator[None]:
    """A progress line with a live elapsed-time counter for a step without a count (engine, build)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed} {postfix}", leave=True, file=sys.stderr)
    stop = threading.Event()

    def tick() -> None:
        # a live clock on a terminal only: in a log file every refresh would be another line
        while not stop.wait(1.0):
            if sys.stderr.isatty():
                bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
        bar.set_postfix_str("done")
    finally:
        stop.set()
        t.join()
        bar.update(1)
        bar.close()


# --- model / engine resolution -------------------------------------------------------------------


@dataclass
class _Run:
    model_dir: Path
    profile: Any  # EngineProfile
    header: Any  # RolloutHeader
    rollouts: list
    source: str  # "engine" | "dump"
    dump_path: Path | None


def _check_model(model_dir: Path) -> Any:
    from transformers import AutoConfig, AutoTokenizer

    from ..families import SUPPORTED_MODEL_TYPES

    if not (model_dir / "config.json").is_file():
        raise AlignmentError(
            f"{model_dir} is not a HF checkpoint directory (no config.json); pass --model DIR"
        )
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} ({model_dir}) is not supported by rlalign-verl diagnose "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use one of those architectures or --tiny"
        )
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - any loader failure is the same user-facing problem
        raise AlignmentError(f"cannot load the tokenizer of {model_dir}: {e}") from e
    if len(tok) > config.vocab_size:
        raise VocabularyMismatchError(
            f"the tokenizer of {model_dir} has {len(tok)} tokens but the model's vocabulary is "
            f"{config.vocab_size}: tokenizer and weights come from different checkpoints; put the matching "
            f"tokenizer files next to the weights"
        )
    return config, tok


def _resolve_profile_for_engine(name: str | None, dist: tuple[str, str]) -> Any:
    from ..profiles import get_profile

    profile = get_profile(name or "vllm-cpu")
    if not (profile.engine == "vllm" and profile.device == "cpu"):
        raise ProfileMismatchError(
            f"--engine {profile.name} describes {profile.engine} on {profile.device}, but the engine installed "
            f"here is {dist[0]} {dist[1]} (CPU); use --engine vllm-cpu (compiled, default) or vllm-cpu-eager, "
            f"or generate the rollouts with {profile.name} on its machine and pass them with --rollout-logprobs"
        )
    return profile


def _resolve_dump_profile(name: str | None, header: Any, path: Path) -> Any:
    from ..profiles import PROFILES, get_profile

    if name is None:
        if header.profile not in PROFILES:
            raise ProfileMismatchError(
                f"{path} was made by {header.engine} {header.engine_version} ({header.mode}) with profile "
                f"{header.profile!r}, which rlalign-verl does not know; pass --engine with one of {', '.join(PROFILES)}"
            )
        return get_profile(header.profile)
    profile = get_profile(name)
    if profile.name != header.profile:
        raise ProfileMismatchError(
            f"--engine {profile.name} contradicts {path}: its rollouts come from {header.engine} "
            f"{header.engine_version} in {header.mode} mode (profile {header.profile}); drop --engine or pass "
            f"--engine {header.profile}"
        )
    return profile


# --- recomputation -------------------------------------------------------------------------------


def _load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    return model


def _response_logprobs(logits, ids, n_prompt: int):
    """fp32 log-probs of the response tokens from ``[T, V]`` logits of ``prompt + response``."""
    logp = logits.float().log_softmax(-1)
    return logp[n_prompt - 1 : -1].gather(-1, ids[n_prompt:, None])[:, 0]


def _recompute(model, rollouts: list, desc: str, floor: Any = None) -> list:
    import torch
    from tqdm.auto import tqdm

    out = []
    with torch.no_grad():
        for r in tqdm(rollouts, desc=desc, leave=False, file=sys.stderr):
            ids = torch.tensor(r.prompt_ids + r.response_ids)
            logits = floor.logits(ids) if floor is not None else model(input_ids=ids[None]).logits[0]
            out.append(_response_logprobs(logits, ids, len(r.prompt_ids)))
    return out


def _metrics(train: list, rollouts: list) -> tuple[dict[str, float], list[float]]:
    import torch

    from ..metrics import compute_mismatch_metrics

    n = max(len(r.response_ids) for r in rollouts)
    t = torch.zeros(len(rollouts), n, dtype=torch.float32)
    e = torch.zeros(len(rollouts), n, dtype=torch.float32)
    mask = torch.zeros(len(rollouts), n, dtype=torch.bool)
    for i, (lp, r) in enumerate(zip(train, rollouts, strict=True)):
        k = len(r.response_ids)
        t[i, :k] = lp
        e[i, :k] = torch.tensor(r.response_logprobs, dtype=torch.float32)
        mask[i, :k] = True
    metrics = compute_mismatch_metrics(t, e, mask)
    per_token = (t - e).abs()[mask].tolist()
    return metrics, per_token


# --- op probe ------------------------------------------------------------------------------------


def _ulps(a, b) -> int:
    import torch

    def key(x):
        i = x.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def _compare(ours, theirs) -> dict[str, float]:
    return {
        "identical": float((ours == theirs).float().mean()),
        "max_ulp": _ulps(ours, theirs),
        "n": ours.numel(),
    }


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    n = sum(p["n"] for p in parts)
    return {
        "identical": sum(p["identical"] * p["n"] for p in parts) / n,
        "max_ulp": max(p["max_ulp"] for p in parts),
        "n": n,
    }


def op_probe(model, *, seed: int = 0, tokens: int = 64) -> dict[str, Any]:
    """Each region function, for every profile, vs the engine's op in both CPU modes, on model shapes.

    Returns ``{"modes": {mode: {profile: {region: {identical, max_ulp, n}}}}, "recommended": {mode:
    profile}}``. ``mode`` is ``"eager"`` (enforce_eager) or ``"compiled"`` (the CPU default).
    """
    import torch

    from ..profiles import PROFILES
    from ..regions.rmsnorm import add_rms_norm, rms_norm
    from ..regions.rope import apply_rope, rope_table
    from ..regions.swiglu import swiglu
    from . import engine_ops as eo

    cfg = model.config
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    eps = float(cfg.rms_norm_eps)
    scale = torch.logspace(-2, 1.5, tokens)[:, None]
    h = (torch.randn(tokens, hidden, generator=gen) * scale).to(bf)
    r = (torch.randn(tokens, hidden, generator=gen) * scale * 4).to(bf)
    w = model.model.norm.weight.detach()
    g = (torch.randn(tokens, inter, generator=gen) * 3).to(bf)
    u = (torch.randn(tokens, inter, generator=gen) * 3).to(bf)
    max_pos = int(cfg.max_position_embeddings)
    pos = torch.cat(
        [torch.arange(tokens // 2), torch.randint(0, max_pos, (tokens - tokens // 2,), generator=gen)]
    )
    q = (torch.randn(tokens, n_q * head_dim, generator=gen) * 3).to(bf)
    k = (torch.randn(tokens, n_kv * head_dim, generator=gen) * 3).to(bf)
    qk_norm = getattr(attn, "q_norm", None)
    rot = model.model.rotary_emb
    cos, sin = rope_table(rot.inv_freq, pos[None], getattr(rot, "attention_scaling", 1.0))

    modes: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        eng_plain = eo.rms_norm(h, w, eps, compiled=compiled)
        eng_fused, _ = eo.rms_norm(h, w, eps, residual=r, compiled=compiled)
        eng_qk = None
        if qk_norm is not None:
            qh = q.view(tokens, n_q, head_dim)
            eng_qk = eo.rms_norm(qh, qk_norm.weight.detach(), eps, compiled=compiled)
        eng_act = eo.silu_and_mul(g, u, compiled=compiled)
        eng_q, eng_k = _engine_rope(eo, model, pos, q, k, head_dim, compiled)
        per_profile: dict[str, dict[str, dict[str, float]]] = {}
        for name, prof in PROFILES.items():
            parts = [
                _compare(rms_norm(h, w, eps, prof.norm), eng_plain),
                _compare(add_rms_norm(h, r, w, eps, prof.norm, round_residual=True)[0], eng_fused),
            ]
            if eng_qk is not None:
                parts.append(
                    _compare(rms_norm(q.view(tokens, n_q, head_dim), qk_norm.weight, eps, prof.norm), eng_qk)
                )
            norm = _merge(parts)
            act = _compare(swiglu(g, u, prof.swiglu), eng_act)
            try:
                c, s = (cos, sin) if prof.rope.table == "fp32" else (cos.to(bf), sin.to(bf))
                q4 = q.view(1, tokens, n_q, head_dim).transpose(1, 2)
                k4 = k.view(1, tokens, n_kv, head_dim).transpose(1, 2)
                q_us, k_us = apply_rope(q4, k4, c, s, prof.rope)
                q_us = q_us.transpose(1, 2).reshape(tokens, -1)
                k_us = k_us.transpose(1, 2).reshape(tokens, -1)
                rope = _merge([_compare(q_us, eng_q), _compare(k_us, eng_k)])
            except ValueError as e:  # pragma: no cover - a profile the rope function refuses
                rope = {"identical": float("nan"), "max_ulp": -1, "n": 0, "error": str(e)}
            per_profile[name] = {"rope": rope, "swiglu": act, "rmsnorm": norm}
        modes[mode] = per_profile
    recommended = {}
    own = {"eager": "vllm-cpu-eager", "compiled": "vllm-cpu"}
    for mode, per_profile in modes.items():
        # highest worst-region identity; ties go to the profile written for this path
        best = max(
            per_profile,
            key=lambda p, m=mode: (min(v["identical"] for v in per_profile[p].values()), p == own[m]),
        )
        recommended[mode] = best
    return {"modes": modes, "recommended": recommended, "tokens": tokens}


def _engine_rope(eo, model, pos, q, k, head_dim, compiled):
    from .engine_ops import _rope_for, _rope_parameters

    cfg = model.config
    mod = _rope_for(
        head_dim, int(cfg.max_position_embeddings), tuple(sorted(_rope_parameters(cfg).items())), q.dtype
    )
    if not compiled:
        return mod.forward_cpu(pos, q.clone(), k.clone())
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    fn = eo._compiled(RotaryEmbedding.forward_static)
    return fn(pos, q, k, head_dim, head_dim, mod.cos_sin_cache.to(q.dtype), True)


# --- main flow -----------------------------------------------------------------------------------


def diagnose(
    *,
    model: str | None = None,
    tiny: str | None = None,
    engine: str | None = None,
    num_prompts: int = 32,
    max_tokens: int = 32,
    rollout_logprobs: str | None = None,
    write_rollouts: str | None = None,
    settings: str = DEFAULT_SETTINGS,
    out: str | Path = "rlalign-diagnose",
    seed: int = 0,
    temperature: float = 1.0,
    floor: bool = True,
    probe: bool = True,
    plots: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """The whole diagnosis; returns the result dict that is also written to ``<out>/diagnose.json``."""
    import torch

    before = torch.get_num_threads()
    try:
        return _diagnose(
            model=model,
            tiny=tiny,
            engine=engine,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            rollout_logprobs=rollout_logprobs,
            write_rollouts=write_rollouts,
            settings=settings,
            out=out,
            seed=seed,
            temperature=temperature,
            floor=floor,
            probe=probe,
            plots=plots,
            threads=threads,
        )
    finally:
        torch.set_num_threads(before)


def _diagnose(
    *,
    model,
    tiny,
    engine,
    num_prompts,
    max_tokens,
    rollout_logprobs,
    write_rollouts,
    settings,
    out,
    seed,
    temperature,
    floor,
    probe,
    plots,
    threads,
) -> dict[str, Any]:
    import torch

    from .rollouts import read_rollouts
    from .runner import INSTALL_HINT, EngineJob, EngineUnavailableError, engine_distribution, run_engine_jobs
    from .tiny import build_tiny_checkpoint, tiny_prompts

    t_start = time.time()
    timing: dict[str, float] = {}
    setting_list = parse_settings(settings)
    if num_prompts < 1 or max_tokens < 1:
        raise AlignmentError("--num-prompts and --max-tokens must be >= 1")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dist = engine_distribution()

    # 1. model + rollouts
    if rollout_logprobs:
        dump = Path(rollout_logprobs)
        from .rollouts import RolloutFormatError

        if not dump.is_file():
            raise RolloutFormatError(f"--rollout-logprobs {dump}: no such file")
        header_only, _ = read_rollouts(dump)
        if model is None and tiny is None:
            if not Path(header_only.model).is_dir():
                raise AlignmentError(
                    f"{dump} was generated from {header_only.model}, which is not on this machine; "
                    f"pass --model DIR with the same checkpoint"
                )
            model = header_only.model
        model_dir = Path(model) if model else build_tiny_checkpoint(tiny or "qwen2")
        config, tok = _check_model(model_dir)
        header, rollouts = read_rollouts(dump, vocab_size=config.vocab_size)
        profile = _resolve_dump_profile(engine, header, dump)
        run_info = _Run(model_dir, profile, header, rollouts, "dump", dump)
    else:
        if dist is None:
            raise EngineUnavailableError(
                f"no inference engine installed here (`import vllm` fails). To fix: {INSTALL_HINT}"
            )
        profile = _resolve_profile_for_engine(engine, dist)
        t = time.time()
        if model:
            model_dir = Path(model)
        else:
            with _stage(f"build tiny {tiny or 'qwen2'} model"):
                model_dir = build_tiny_checkpoint(tiny or "qwen2")
        config, tok = _check_model(model_dir)
        timing["model_build_s"] = time.time() - t
        prompts = tiny_prompts(tok, num_prompts, seed=seed)
        dump = Path(write_rollouts) if write_rollouts else out_dir / "rollouts.jsonl"
        job = EngineJob(
            model_dir=str(model_dir),
            prompts=prompts,
            max_tokens=max_tokens,
            out=str(dump),
            seed=seed,
            temperature=temperature,
            enforce_eager=profile.name.endswith("-eager"),
        )
        t = time.time()
        with _stage(f"generate {num_prompts}x{max_tokens} tokens with {dist[0]} {dist[1]} ({profile.name})"):
            run_engine_jobs([job], log_path=out_dir / "engine.log")
        timing["engine_s"] = time.time() - t
        header, rollouts = read_rollouts(dump, vocab_size=config.vocab_size)
        run_info = _Run(model_dir, profile, header, rollouts, "engine", dump)

    # 2. recompute
    from ..patch import apply_alignment, remove_alignment

    if threads is None:
        threads = 1 if config.hidden_size <= 1024 else torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    t = time.time()
    hf = _load_hf(model_dir)
    timing["hf_load_s"] = time.time() - t
    results: dict[str, Any] = {}
    per_token: dict[str, list[float]] = {}

    def run_setting(label: str, regions: tuple[str, ...], note: str = "") -> None:
        apply_alignment(hf, regions=regions, engine=profile.name)
        lps = _recompute(hf, rollouts, f"recompute [{label}]{note}")
        remove_alignment(hf)
        results[label], per_token[label] = _metrics(lps, rollouts)
        results[label]["regions"] = list(regions)

    t = time.time()
    for label, regions in setting_list:
        run_setting(label, regions)
    timing["recompute_s"] = time.time() - t
    extra = _extra_settings(results, setting_list)
    for label, regions in extra:
        run_setting(label, regions, " (for the recommendation)")
        results[label]["extra"] = True

    floor_result: dict[str, Any] | None = None
    floor_note = None
    if floor:
        floor_result, floor_note = _floor(hf, rollouts, profile, dist, timing)
        if floor_result is not None:
            floor_result, per_token["floor"] = floor_result
    probe_result = None
    if probe:
        if dist is None:
            probe_result = {"skipped": "vLLM is not installed here: the probe needs the engine's own ops"}
        else:
            t = time.time()
            with _stage("op probe (engine ops vs region functions)"):
                probe_result = op_probe(hf, seed=seed)
            timing["probe_s"] = time.time() - t

    timing["total_s"] = time.time() - t_start
    result: dict[str, Any] = {
        "engine": {
            "name": header.engine,
            "version": header.engine_version,
            "mode": header.mode,
            "profile": profile.name,
            "compilation": header.compilation,
            "device": header.device,
            "source": run_info.source,
            "rollouts": str(run_info.dump_path) if run_info.dump_path else None,
            "installed": {"name": dist[0], "version": dist[1]} if dist else None,
        },
        "model": {
            "path": str(model_dir),
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size,
            "tiny": None if model else (tiny or "qwen2"),
        },
        "sampling": {**header.sampling, "seed": header.seed, "num_prompts": len(rollouts)},
        "settings": results,
        "floor": floor_result,
        "floor_note": floor_note,
        "op_probe": probe_result,
        "recommendation": recommend(results, floor_result),
        "timing": {k: round(v, 2) for k, v in timing.items()},
        "threads": threads,
        "per_token_abs_diff": per_token,
    }
    json_path = out_dir / "diagnose.json"
    json_path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    paths: dict[str, Any] = {"json": str(json_path)}
    if plots:
        paths["plots"] = write_plots(result, out_dir)
    result["paths"] = paths
    return result


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def _extra_settings(results: dict[str, Any], setting_list: list) -> list[tuple[str, tuple[str, ...]]]:
    """Region pairs to evaluate when no evaluated setting smaller than 'all' reaches the target."""
    labels = {lab for lab, _ in setting_list}
    if "none" not in labels or "all" not in labels:
        return []
    if recommend(results, None).get("regions") not in (None, list(REGIONS)):
        return []
    from itertools import combinations

    have = {tuple(r) for _, r in setting_list}
    return [(_label(p), p) for p in combinations(REGIONS, 2) if p not in have]


def _floor(hf, rollouts, profile, dist, timing) -> tuple[Any, str | None]:
    if dist is None:
        return None, "floor skipped: vLLM is not installed here (the floor runs the engine's own ops)"
    if profile.engine != "vllm" or profile.device != "cpu":
        return None, (
            f"floor skipped: the rollouts come from {profile.name} ({profile.engine} on {profile.device}); "
            "the floor needs that engine's ops on this machine"
        )
    from .engine_ops import EngineFloor

    compiled = not profile.name.endswith("-eager")
    t = time.time()
    fl = EngineFloor(hf, compiled=compiled)
    what = "compiled with Inductor as the engine" if compiled else "eager"
    lps = _recompute(None, rollouts, f"floor [engine ops, {what}]", floor=fl)
    timing["floor_s"] = time.time() - t
    metrics, per_token = _metrics(lps, rollouts)
    metrics["compiled"] = compiled
    return (metrics, per_token), None


def recommend(results: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Smallest evaluated region set reaching >= 90% of the all-regions reduction of mean |dlogp|."""
    key = "mismatch/logp_abs_diff_mean"
    if "none" not in results or "all" not in results:
        return {"regions": None, "text": "add 'none' and 'all' to --settings for a recommendation"}
    base, full = results["none"][key], results["all"][key]
    reduction = base - full
    out: dict[str, Any] = {"baseline": base, "all_regions": full, "all_regions_reduction": reduction}
    if floor is not None:
        out["floor"] = floor[key]
        out["aligned_over_floor"] = full / floor[key] if floor[key] > 0 else None
        out["reducible_part_removed"] = (base - full) / (base - floor[key]) if base > floor[key] else None
    if reduction <= 0:
        out.update(regions=[], text=f"aligning does not reduce mean |dlogp| here ({base:.4g} -> {full:.4g})")
        return out
    candidates = []
    for label, r in results.items():
        if label == "none":
            continue
        got = (base - r[key]) / reduction
        candidates.append((len(r["regions"]), -got, label, got, r["regions"]))
    candidates.sort()
    for _n, _, label, got, regions in candidates:
        if got >= RECOMMEND_FRACTION:
            out.update(
                regions=regions,
                setting=label,
                fraction_of_all=got,
                text=(
                    f"align {label} (alignment.regions={regions}): {100 * got:.0f}% of the all-regions "
                    f"reduction (mean |dlogp| {base:.4g} -> {results[label][key]:.4g})"
                ),
            )
            return out
    out.update(regions=list(REGIONS), setting="all", fraction_of_all=1.0, text="align all regions")
    return out


# --- output --------------------------------------------------------------------------------------


def format_report(result: dict[str, Any]) -> str:
    """The terminal table."""
    e, m = result["engine"], result["model"]
    lines = [
        f"engine: {e['name']} {e['version']} ({e['mode']}, profile {e['profile']}, rollouts from {e['source']})",
        f"model:  {m['model_type']} hidden {m['hidden_size']} x {m['num_layers']} layers ({m['path']})",
        f"tokens: {result['settings'][next(iter(result['settings']))]['mismatch/num_tokens']} sampled "
        f"({result['sampling']['num_prompts']} prompts), HF transformers bf16 sdpa recomputation",
        "",
    ]
    floor = result.get("floor")
    fmean = floor["mismatch/logp_abs_diff_mean"] if floor else None
    base = result["settings"].get("none", {}).get("mismatch/logp_abs_diff_mean")
    head = f"{'setting':<22}" + "".join(f"{n:>11}" for n, _ in KEY_METRICS) + f"{'vs none':>9}{'/floor':>8}"
    lines += [head, "-" * len(head)]
    rows = [(lab, r) for lab, r in result["settings"].items()]
    if floor:
        rows.append(("floor (engine ops)", floor))
    for label, r in rows:
        cells = "".join(f"{r[k]:>11.4g}" for _, k in KEY_METRICS)
        mean = r["mismatch/logp_abs_diff_mean"]
        vs = f"{100 * (mean / base - 1):>+8.0f}%" if base else f"{'':>9}"
        rel = f"{mean / fmean:>8.2f}" if fmean else f"{'':>8}"
        name = label + (" *" if r.get("extra") else "")
        lines.append(f"{name:<22}{cells}{vs}{rel}")
    if any(r.get("extra") for _, r in rows):
        lines.append("  * evaluated only for the recommendation")
    if result.get("floor_note"):
        lines.append(result["floor_note"])
    probe = result.get("op_probe")
    if probe and "modes" in probe:
        lines += [
            "",
            "op probe: bit-identical elements / max ULP, region function with the profile vs the engine op",
        ]
        for mode, per in probe["modes"].items():
            rec = probe["recommended"][mode]
            for prof in dict.fromkeys([rec, "vllm-cpu" if mode == "compiled" else "vllm-cpu-eager", "hf"]):
                cells = "  ".join(
                    f"{reg} {100 * v['identical']:.3f}%/{v['max_ulp']}" for reg, v in per[prof].items()
                )
                mark = "  <- recommended" if prof == rec else ""
                lines.append(f"  engine {mode:<8} profile {prof:<15} {cells}{mark}")
    lines += ["", "recommendation: " + result["recommendation"]["text"]]
    return "\n".join(lines)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``gaps.png`` (per-setting bars: mean and p99 |dlogp|) and ``abs_diff.png`` (histogram + CDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = dict(result["settings"])
    if result.get("floor"):
        rows["floor"] = result["floor"]
    labels = list(rows)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 3, 4))
    for i, (name, key) in enumerate(
        (("mean", "mismatch/logp_abs_diff_mean"), ("p99", "mismatch/logp_abs_diff_p99"))
    ):
        ax.bar(x + (i - 0.5) * 0.38, [rows[lab][key] for lab in labels], 0.38, label=f"{name} |Δlogp|")
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel("|logp_train - logp_engine| (nats)")
    e = result["engine"]
    ax.set_title(f"{result['model']['model_type']} vs {e['name']} {e['version']} ({e['profile']})")
    ax.legend()
    fig.tight_layout()
    bars = out_dir / "gaps.png"
    fig.savefig(bars, dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    data = {k: np.asarray(v) for k, v in result["per_token_abs_diff"].items()}
    positive = np.concatenate([d[d > 0] for d in data.values()]) if data else np.array([])
    lo = max(positive.min(), 1e-7) if positive.size else 1e-6
    hi = max(positive.max(), lo * 10) if positive.size else 1.0
    bins = np.logspace(np.log10(lo), np.log10(hi), 40)
    for name, d in data.items():
        a1.hist(np.clip(d, lo, None), bins=bins, histtype="step", label=name)
        srt = np.sort(d)
        a2.plot(np.clip(srt, lo, None), np.arange(1, len(srt) + 1) / len(srt), label=name)
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xlabel("|Δlogp| per token (nats; 0 shown at the left edge)")
    a1.set_ylabel("tokens")
    a2.set_ylabel("fraction of tokens ≤ x")
    a2.legend(fontsize=8)
    fig.tight_layout()
    hist = out_dir / "abs_diff.png"
    fig.savefig(hist, dpi=110)
    plt.close(fig)
    return [str(bars), str(hist)]
