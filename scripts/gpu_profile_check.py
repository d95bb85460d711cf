#!/usr/bin/env python
"""Check the CUDA engine profiles against the engines' own CUDA ops, region by region.

For every region (rmsnorm, add+rmsnorm, swiglu, rope, plus the Qwen3 q/k-norm -> RoPE chain and the
``vllm`` graph piece) and every CUDA profile (``vllm-eager``, ``vllm``, ``sglang`` when ``sgl_kernel`` is
importable), this runs the engine's op and our region function (:mod:`rlalign_verl.align.regions`) on the
same random bf16 inputs and reports the fraction of bit-identical output elements and the largest
distance in units in the last place (ULP). Engine ops:

* ``vllm-eager``: vLLM's CUDA kernels ``torch.ops._C.rms_norm``, ``fused_add_rms_norm``,
  ``silu_and_mul``, ``rotary_embedding`` (what ``enforce_eager=True`` runs);
* ``vllm``: vLLM's native op implementations compiled with ``torch.compile(backend="inductor")``
  and a dynamic token dimension, the way vLLM's default (compiled) path runs them;
* ``sglang``: ``sgl_kernel.rmsnorm``, ``fused_add_rmsnorm``, ``silu_and_mul``,
  ``apply_rope_with_cos_sin_cache_inplace`` with SGLang's fp32 cos/sin cache.

On CUDA it also compares the optional Triton kernels (:mod:`rlalign_verl.align.kernels`, profile column
``triton``) with the PyTorch region functions they replace (expected: 100 % identical).

Each norm/SwiGLU/RoPE row also scores the other rounding variants a profile could have (``best``
column), so a mismatch says which field value the engine really uses.

Run on a GPU machine with vLLM's CUDA build (no network needed, a few minutes)::

    python scripts/gpu_profile_check.py            # table on stdout, JSON to $OUT/ or ./gpu_check.json
    python scripts/gpu_profile_check.py --quick    # two hidden sizes only

Bundle mode (``--bundle DIR``, the GPU machine without vLLM; ``scripts/gpu_device_check.sh`` and
docs/gpu-check.md): the engines' ops come from the bundle ``scripts/gpu_bundle.py`` makes -- vLLM's CUDA
kernels built there (``vllm-eager``), vLLM's native-op sources compiled with its Inductor settings
(``vllm``), FlashInfer's norm/RoPE kernels as sgl-kernel calls them (``sglang``, no SwiGLU).

Without CUDA or without vLLM's CUDA build it prints ``skipped: ...`` and exits 0. ``--device cpu`` runs
the same machinery against vLLM's CPU ops (a development aid: its numbers say nothing about CUDA).
On CPU each engine is checked against its CPU build's profile (``vllm`` -> ``vllm-cpu``, ``vllm-eager`` ->
``vllm-cpu-eager``); ``--plant PROFILE`` checks every engine against PROFILE instead (a self-test: a wrong
profile must fail). Exit status: 0 when every row passes, 1 when any case raised, any row's best rounding
variant is not the profile's own, a Triton row is not bit-identical, or nothing was compared (the reasons
are printed and in the JSON's ``problems``); 2 for bad arguments or an unusable bundle.

End-to-end step (when ``vllm`` is among ``--profiles``; ``--no-e2e`` skips it, ``--e2e-only`` runs only it):
``scripts/e2e_check.py`` samples rollouts from a tiny local model with the installed engine
(vLLM's CUDA build on CUDA), recomputes them with each region setting and the floor, and fails when all
regions do not reach the floor's interval or are not below ``none`` (key ``e2e`` in the JSON). With
``--bundle`` the floor built from the bundle samples (``gpu_bundle_e2e.py``; ``vllm`` and ``vllm-eager``).
On CUDA it also runs ``scripts/gpu_moe_check.py``'s rows (vLLM's fused MoE router and experts vs the
``vllm`` profile's MoE data, top-k 2 and 8; key ``moe``; where sglang imports, SGLang's router, experts and
Qwen2-MoE block sum vs the ``sglang`` profile's, keys ``moe.sglang_top2/8``); each of its misses is a problem.
With ``--bundle``: the router rows of the built ``topk_softmax`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# the one bit-level comparison helper (pure torch), shared with diagnose and the tests
from rlalign_verl.tools.diagnose.bits import bit_identical, compare, ulp_distance  # noqa: F401

CUDA_PROFILES = ("vllm-eager", "vllm", "sglang")

BUNDLE: Any = None
"""With ``--bundle``: the engines' ops from the bundle (``gpu_bundle_natives.BundleOps``), no vLLM needed."""


_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)


engines_mod = importlib.import_module("gpu_check_engines")  # the engine side
cases = importlib.import_module("gpu_check_cases")  # the cases and rows
Engine, Row, run_cases, kernel_rows = engines_mod.Engine, cases.Row, cases.run_cases, cases.kernel_rows
# the comparison helpers, here for the tests and callers of this script
_finish, _norm_variants, _guarded = cases._finish, cases._norm_variants, cases._guarded
_to_heads, _from_heads, _table_from_cache = cases._to_heads, cases._from_heads, cases._table_from_cache
HIDDEN_SIZES, INTERMEDIATE, EPS = cases.HIDDEN_SIZES, cases.INTERMEDIATE, cases.EPS


def make_engines(profiles: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The engines for ``profiles`` (the bundle's with ``--bundle``); those that cannot run come back second."""
    return engines_mod.make_engines(profiles, BUNDLE)


# --- environment --------------------------------------------------------------------------------


def environment_status(device: str, bundle: bool = False) -> tuple[bool, str]:
    """``(ok, reason)``: whether this machine can run the check on ``device`` (``bundle``: with the bundle's
    ops, which need no vLLM)."""
    if device == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine"
    if bundle:
        return True, "ok"
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed"
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
        from vllm.platforms import current_platform
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        return False, f"vLLM cannot be imported ({type(exc).__name__}: {exc})"
    if device == "cuda" and not current_platform.is_cuda():
        return False, f"this vLLM is not the CUDA build (platform: {type(current_platform).__name__})"
    missing = [
        op
        for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
        if not hasattr(torch.ops._C, op)
    ]
    if missing:
        return False, f"vLLM's compiled ops are missing: {missing}"
    return True, "ok"


def _vllm_version() -> str:
    if BUNDLE is not None:
        return f"{BUNDLE.bundle.vllm_version} (bundle)"
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover
        return "unknown"


# --- output -------------------------------------------------------------------------------------


def verdict(rows: list[Row]) -> list[str]:
    """Why this run fails (empty: it passes): a case that raised, a row where another rounding variant
    matches the engine better than the profile's own, a Triton row that is not bit-identical, or nothing
    compared at all."""
    problems = [f"{r.region}/{r.profile}/{r.shape}/{r.output}: {r.error}" for r in rows if r.error]
    compared = [r for r in rows if r.result is not None]
    if not compared:
        problems.append("nothing was compared (no engine could run here)")
    for r in compared:
        own = r.result["identical"]
        if r.best is not None and r.best[1] - own > 1e-6:  # float noise between the two fraction sums
            problems.append(
                f"{r.region}/{r.profile}/{r.shape}/{r.output}: the profile matches {100 * own:.3f}% but "
                f"{r.best[0]} matches {100 * r.best[1]:.3f}%"
            )
        elif r.profile == "triton" and own < 1.0:
            problems.append(
                f"{r.region}/triton/{r.shape}: Triton kernel {100 * own:.3f}% identical to PyTorch"
            )
    return problems


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table with the best variant of each."""
    head = f"{'region':<12} {'profile':<10} {'shape':<36} {'output':<9} {'identical':>10} {'differ':>7} {'max_ulp':>8}  best variant"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.region:<12} {r.profile:<10} {r.shape:<36} {r.output:<9} ERROR {r.error}")
            continue
        assert r.result is not None
        best = f"{r.best[0]} ({100 * r.best[1]:.3f}%)" if r.best else ""
        lines.append(
            f"{r.region:<12} {r.profile:<10} {r.shape:<36} {r.output:<9} "
            f"{100 * r.result['identical']:>9.3f}% {r.result['differing']:>7} {r.result['max_ulp']:>8}  {best}"
        )
    return "\n".join(lines)


def default_json_path(explicit: str | None) -> Path:
    """``--out``, else ``$OUT/gpu_check.json``, else ``./gpu_check.json``."""
    if explicit:
        return Path(explicit)
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    """Run the check; see the module docstring for the exit codes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--profiles",
        default=",".join(CUDA_PROFILES),
        help=f"comma-separated subset of {', '.join(CUDA_PROFILES)}",
    )
    parser.add_argument("--quick", action="store_true", help="hidden sizes 896 and 4096 only")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: development run against vLLM's CPU ops (not a CUDA verification)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plant",
        default=None,
        help="check every engine against this (wrong) profile instead: the run must then exit 1",
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)"
    )
    _add_e2e_args(parser)
    _add_bundle_args(parser)
    args = parser.parse_args(argv)

    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in profiles if p not in CUDA_PROFILES]
    if bad:
        parser.error(f"unknown profile(s) {bad}; choose from {', '.join(CUDA_PROFILES)}")

    if args.bundle and args.e2e_rollouts:
        parser.error("--e2e-rollouts cannot be used with --bundle (the bundle's floor samples its own)")
    ok, reason = environment_status(args.device, bundle=bool(args.bundle))
    if not ok:
        print(f"skipped: {reason} -- needs CUDA and vLLM's CUDA build")
        if args.out or os.environ.get("OUT"):
            _write_json(default_json_path(args.out), {"status": "skipped", "reason": reason})
        return 0

    started = time.time()
    if args.bundle:
        failed = _open_bundle(args)
        if failed is not None:
            return failed
    if args.device == "cpu":
        print("development run on CPU against vLLM's CPU ops: these numbers do NOT verify the CUDA profiles")
    engines, unavailable = make_engines(profiles)
    if args.device == "cpu" and not args.plant and "vllm-eager" in engines:
        del engines[
            "vllm-eager"
        ]  # vllm-cpu-eager runs forward_native norms/SiluAndMul, not these C++ kernels
        unavailable["vllm-eager"] = (
            "on CPU torch.ops._C's kernels are not what vllm-cpu-eager runs (forward_native)"
        )
    for name, why in unavailable.items():
        print(f"profile {name}: not checked ({why})")
    checked = _checked_profiles(list(engines), args.device, args.plant)
    with torch.no_grad():
        rows = (
            [] if args.e2e_only else run_cases(engines, args.device, args.quick, args.seed, checked, BUNDLE)
        )
        if args.device == "cuda" and not args.e2e_only:
            rows += kernel_rows(args.device, args.quick, args.seed)
    print(format_table(rows))
    errors = sum(r.error is not None for r in rows)
    e2e = _e2e_step(args, profiles)
    moe = None if args.e2e_only else _moe_step(args.device)
    problems = ([] if args.e2e_only else verdict(rows)) + (e2e["problems"] if e2e else [])
    problems += moe["misses"] if moe else []
    problems += [
        f"bundle: vLLM's compile settings moved: {a}" for a in (BUNDLE.anchors_missing if BUNDLE else [])
    ]
    if args.e2e_only and e2e is None:
        problems.append("nothing was compared (--e2e-only without the vllm profile)")
    payload = {
        "verdict": "fail" if problems else "pass",
        "problems": problems,
        "checked_profiles": checked,
        "status": "ran",
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "vllm": _vllm_version(),
        "sgl_kernel": _sgl_kernel(),
        "bundle": BUNDLE.summary() if BUNDLE is not None else None,
        "profiles_unavailable": unavailable,
        "seconds": round(time.time() - started, 1),
        "errors": errors,
        "rows": [dataclasses.asdict(r) for r in rows],
        "e2e": e2e,
        "moe": moe,
    }
    _write_json(default_json_path(args.out), payload)
    print(f"{len(rows)} comparisons, {errors} errors, {payload['seconds']} s")
    for line in problems:
        print(f"FAIL {line}")
    print("verdict: " + ("FAIL" if problems else "pass"))
    return 1 if problems else 0


def _add_e2e_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("end-to-end step (the vllm profile, engine's default compiled mode)")
    g.add_argument("--no-e2e", action="store_true", help="skip the end-to-end step")
    g.add_argument("--e2e-only", action="store_true", help="run only the end-to-end step")
    g.add_argument("--e2e-arch", default="qwen3", choices=("qwen2", "qwen3", "llama"))
    g.add_argument("--e2e-prompts", type=int, default=16)
    g.add_argument("--e2e-tokens", type=int, default=32)
    g.add_argument(
        "--e2e-rollouts", default=None, help="reuse this dump of an earlier run instead of sampling"
    )


def _add_bundle_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("bundle mode (the GPU machine without vLLM: docs/gpu-check.md)")
    g.add_argument("--bundle", default=None, metavar="DIR", help="take the engines' ops from this bundle")
    g.add_argument("--build-dir", type=Path, default=None, help="where the bundle's kernels are built")


def _open_bundle(args: argparse.Namespace) -> int | None:
    """Set :data:`BUNDLE` from ``--bundle`` (building its kernels on CUDA); an exit status when that fails."""
    global BUNDLE
    natives = importlib.import_module("gpu_bundle_natives")
    try:
        BUNDLE = natives.prepare(args.bundle, args.device, args.build_dir)
    except natives.BundleError as exc:
        print(f"gpu_profile_check: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the build failed: the compiler's output is above
        traceback.print_exc()
        print(f"FAIL bundle: {type(exc).__name__}: {str(exc)[-500:]}")
        return 1
    print(f"bundle {args.bundle}: vLLM {BUNDLE.bundle.vllm_version}, {BUNDLE.timing}, notes {BUNDLE.notes}")
    return None


def _sgl_kernel() -> bool | str:
    if BUNDLE is not None:
        return f"FlashInfer {BUNDLE.summary()['flashinfer']} (bundle)" if BUNDLE.fi is not None else False
    return importlib.util.find_spec("sgl_kernel") is not None


def _e2e_step(args: argparse.Namespace, profiles: list[str]) -> dict[str, Any] | None:
    """diagnose's pipeline on a tiny model (``scripts/e2e_check.py``), or None when not run."""
    if BUNDLE is not None:
        return _bundle_e2e_step(args, profiles)
    if args.no_e2e or "vllm" not in profiles:
        return None
    from e2e_check import run_e2e

    profile = _checked_profiles(["vllm"], args.device, args.plant)["vllm"]
    out_dir = default_json_path(args.out).parent / "e2e"
    try:
        e2e = run_e2e(args.device, profile, arch=args.e2e_arch, prompts=args.e2e_prompts,
                      tokens=args.e2e_tokens, seed=args.seed, out_dir=out_dir,
                      rollouts_from=Path(args.e2e_rollouts) if args.e2e_rollouts else None)  # fmt: skip
    except Exception as exc:  # a failed step is a miss, reported like a failed case
        traceback.print_exc()
        return {"profile": profile, "rows": {}, "problems": [f"e2e: {type(exc).__name__}: {exc}"]}
    for label, row in e2e["rows"].items():
        lo, hi = row["ci95"]["mismatch/logp_abs_diff_mean"]
        print(
            f"e2e {e2e['arch']} [{profile}] {label:<8} mean |dlogp| {row['mean_abs_dlogp']:.4f} [{lo:.4f}, {hi:.4f}]"
        )
    return e2e


def _bundle_e2e_step(args: argparse.Namespace, profiles: list[str]) -> dict[str, Any] | None:
    """The e2e step with the bundle's floor, for vllm (compiled) and vllm-eager (built kernels)."""
    paths = [p for p in profiles if p in ("vllm", "vllm-eager")]
    if args.no_e2e or not paths:
        return None
    checked = _checked_profiles(paths, args.device, args.plant)
    return importlib.import_module("gpu_bundle_e2e").e2e_step(
        BUNDLE, checked, arch=args.e2e_arch, prompts=args.e2e_prompts, tokens=args.e2e_tokens, seed=args.seed
    )


def _moe_step(device: str) -> dict[str, Any] | None:
    """scripts/gpu_moe_check.py's rows and misses at top-k 2 and 8 (CUDA only: it runs vLLM's fused MoE ops, and
    SGLang's where sglang imports: keys ``sglang_top2``/``sglang_top8``)."""
    if device != "cuda":
        return None
    if BUNDLE is not None:  # the router from the built topk_softmax; the expert rows need vLLM's fused_moe
        return importlib.import_module("gpu_bundle_e2e").moe_step(BUNDLE)
    spec = importlib.util.spec_from_file_location(
        "gpu_moe_check", Path(__file__).with_name("gpu_moe_check.py")
    )
    assert spec is not None and spec.loader is not None
    moe_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_check)
    result: dict[str, Any] = {"misses": []}
    for top_k in (2, 8):
        try:
            rows = moe_check.moe_rows(device, top_k=top_k)
        except Exception as exc:  # a step that cannot run is a miss, reported like a failed case
            traceback.print_exc()
            result["misses"].append(f"moe top-{top_k}: {type(exc).__name__}: {exc}")
            continue
        result[f"top{top_k}"] = rows
        result["misses"] += [f"moe top-{top_k}: {m}" for m in moe_check.misses(rows)]
        for name, frac in rows.items():
            print(f"moe top-{top_k} {name:<44} {100 * frac:8.3f}% bit-identical")
    for top_k in (2, 8):  # the sglang profile's MoE data vs SGLang's ops, where sglang imports
        try:
            rows = moe_check.sglang_rows(device, top_k=top_k)
        except Exception as exc:
            traceback.print_exc()
            result["misses"].append(f"moe sglang top-{top_k}: {type(exc).__name__}: {exc}")
            continue
        if rows is None:
            break
        result[f"sglang_top{top_k}"] = rows
        result["misses"] += [f"moe sglang top-{top_k}: {m}" for m in moe_check.sglang_misses(rows)]
        for name, frac in rows.items():
            print(f"moe sglang top-{top_k} {name:<37} {100 * frac:8.3f}% bit-identical")
    return result


def _checked_profiles(engines: list[str], device: str, plant: str | None) -> dict[str, str]:
    """The profile each engine is checked against: its own, its CPU build's (``--device cpu``), or ``plant``."""
    from rlalign_verl.catalog.placement import DEVICE_COUNTERPART
    from rlalign_verl.catalog.profiles import get_profile

    if plant:
        return dict.fromkeys(engines, get_profile(plant).name)
    return {e: DEVICE_COUNTERPART.get((e, device), e) for e in engines}


if __name__ == "__main__":
    sys.exit(main())
