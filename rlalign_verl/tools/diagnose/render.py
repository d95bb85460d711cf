"""``diagnose`` output: the terminal table and the PNG plots (matplotlib is imported here only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlalign_verl.base.files import atomic_target
from rlalign_verl.tools.diagnose.ladder import format_ladder
from rlalign_verl.tools.diagnose.moe_routes import FLIP_KEY
from rlalign_verl.tools.diagnose.recommend import flip_change, floor_relation
from rlalign_verl.tools.diagnose.stats import CI_KEYS

KEY_METRICS = (
    ("mean", "mismatch/logp_abs_diff_mean"),
    ("p99", "mismatch/logp_abs_diff_p99"),
    ("max", "mismatch/logp_abs_diff_max"),
    ("k3 KL", "mismatch/kl_k3"),
    ("max ratio", "mismatch/ratio_max"),
)
FLOOR_LABEL = "floor (engine ops)"
FLOOR_NOTE = (
    "floor: the three regions computed by the engine's own ops inside the HF model; what is left there "
    "comes from matmuls, attention, lm_head and log-softmax, which no region alignment touches. A setting "
    "whose interval overlaps the floor's is at the floor, within noise."
)


def _ci(r: dict[str, Any], key: str) -> str:
    ci = (r.get("ci95") or {}).get(key)
    return f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""


def _flip_cell(r: dict[str, Any]) -> str:
    if FLIP_KEY not in r:
        return f"{'':>24}"
    ci = (r.get("ci95") or {}).get(FLIP_KEY)
    band = f" [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" if ci else ""
    return f"{f'{100 * r[FLIP_KEY]:.2f}%{band}':>24}"


def _flip_line(settings: dict[str, Any]) -> str:
    """Each setting's route-flip change against none; a change inside the 95% intervals is noise."""
    changes = {lab: flip_change(settings["none"], r) for lab, r in settings.items() if lab != "none"}
    return "route flips vs none (95% intervals): " + ", ".join(f"{k} {v}" for k, v in changes.items() if v)


def _header(result: dict[str, Any]) -> list[str]:
    e, m, s = result["engine"], result["model"], result["sampling"]
    first = result["settings"][next(iter(result["settings"]))]
    seeds = f", {s['seeds']} samples per prompt pooled" if s.get("seeds", 1) > 1 else ""
    return [
        f"engine: {e['name']} {e['version']} ({e['mode']}, profile {e['profile']}, rollouts from {e['source']})",
        f"model:  {m['model_type']} hidden {m['hidden_size']} x {m['num_layers']} layers ({m['path']})",
        f"tokens: {first['mismatch/num_tokens']} sampled ({s['num_prompts']} prompts{seeds}), "
        "HF transformers bf16 sdpa recomputation; [..] = 95% bootstrap interval over prompts",
        *_temperature_line(e),
        "",
    ]


def _temperature_line(e: dict[str, Any]) -> list[str]:
    t = e.get("logprob_temperature", 1.0)
    if t == 1.0:
        return []
    return [
        f"log-probs: {e.get('logprobs_mode')} at temperature {t:g}: the recomputed logits are divided by "
        f"{t:g} in fp32 before the log-softmax, as the engine did"
    ]


def _table(result: dict[str, Any]) -> list[str]:
    floor = result.get("floor")
    fmean = floor[CI_KEYS[0]] if floor else None
    base = result["settings"].get("none", {}).get(CI_KEYS[0])
    head = f"{'setting':<22}" + "".join(f"{n:>11}" for n, _ in KEY_METRICS)
    head += f"{'mean 95% CI':>22}{'vs none':>9}{'/floor':>8}"
    has_flips = any(FLIP_KEY in r for r in result["settings"].values())
    head += f"{'route flip [95% CI]':>24}" if has_flips else ""
    head += "  vs floor"
    lines = [head, "-" * len(head)]
    rows = list(result["settings"].items()) + ([(FLOOR_LABEL, floor)] if floor else [])
    for label, r in rows:
        cells = "".join(f"{r[k]:>11.4g}" for _, k in KEY_METRICS)
        mean = r[CI_KEYS[0]]
        vs = f"{100 * (mean / base - 1):>+8.0f}%" if base else f"{'':>9}"
        rel = f"{mean / fmean:>8.2f}" if fmean else f"{'':>8}"
        where = "" if label == FLOOR_LABEL else (floor_relation(r, floor) or "")
        name = label + (" *" if r.get("extra") else "")
        flip_cell = _flip_cell(r) if has_flips else ""
        lines.append(f"{name:<22}{cells}{_ci(r, CI_KEYS[0]):>22}{vs}{rel}{flip_cell}  {where}".rstrip())
    if has_flips and "none" in result["settings"]:
        lines.append(_flip_line(result["settings"]))
    if any(r.get("extra") for _, r in rows):
        lines.append("  * evaluated only for the recommendation")
    tp = (result.get("engine") or {}).get("tensor_parallel_size") or 1
    tp_note = (
        f" At tensor parallel {tp} the floor's o_proj/down_proj run as the engine's ranks and its all-reduce "
        "compute them (the tp region's rounding location)."
        if tp > 1
        else ""
    )
    lines.append(FLOOR_NOTE + tp_note if floor else (result.get("floor_note") or ""))
    return lines


def _pct(identical: float, n: int, differing: int) -> str:
    """A bit-identical fraction, truncated (never rounded up to 100%); ``n/a`` when nothing was compared."""
    if n == 0:
        return "n/a"
    if differing == 0:
        return "100%"
    return f"{math.floor(1e5 * identical) / 1e3:.3f}%"


def _moe_probe(per: dict[str, Any], mode: str) -> list[str]:
    lines = []
    for prof, rows in per.items():
        r, e = rows["router"], rows["experts"]
        ids = _pct(r["ids_identical"], r["tokens"], r["ids_differing"])
        lines.append(
            f"  engine {mode:<8} profile {prof:<15} router ids {ids} of {r['tokens']} tokens, weights "
            f"{_pct(r['identical'], r['n'], r['differing'])}/{r['max_ulp']} fp32 ulp  experts+combine "
            f"{_pct(e['identical'], e['n'], e['differing'])} ({e['differing']} of {e['n']} differ)/{e['max_ulp']}"
        )
    return lines


def _probe(probe: dict[str, Any] | None) -> list[str]:
    if not probe or "modes" not in probe:
        return []
    lines = [
        "",
        "op probe: bit-identical elements / max ULP, region function with the profile vs the engine op",
    ]
    for mode, per in probe["modes"].items():
        rec = probe["recommended"][mode]
        for prof in dict.fromkeys([rec, "vllm-cpu" if mode == "compiled" else "vllm-cpu-eager", "hf"]):
            cells = "  ".join(
                f"{reg} {_pct(v['identical'], v['n'], v['differing'])}/{v['max_ulp']}"
                for reg, v in per[prof].items()
            )
            mark = "  <- recommended" if prof == rec else ""
            lines.append(f"  engine {mode:<8} profile {prof:<15} {cells}{mark}")
    if probe.get("moe"):
        lines.append("MoE ops (first sparse block's weights) vs CPURouter._softmax_topk / cpu_fused_moe:")
        for mode, per in probe["moe"].items():
            lines += _moe_probe(per, mode)
    return lines


def format_report(result: dict[str, Any]) -> str:
    """The terminal table."""
    lines = (
        _header(result)
        + _table(result)
        + format_ladder(result.get("ladder"))
        + _probe(result.get("op_probe"))
    )
    lines += _doctor(result.get("doctor"))
    lines += ["", "recommendation: " + result["recommendation"]["text"]]
    return "\n".join(lines)


def _doctor(doctor: dict[str, list[str]] | None) -> list[str]:
    """The doctor's verdict on the gap (docs/reading-a-mismatch.md): rounding's signature, or each other cause."""
    if not doctor:
        return []
    out = [""]
    for label, found in doctor.items():
        if not found:
            out.append(
                f"doctor [{label}]: the gap has rounding's signature (no bias, tails or growth beyond it)"
            )
        out += [f"doctor [{label}]: {line}" for line in found]
    return out


def _gaps_plot(plt: Any, result: dict[str, Any], path: Path) -> None:
    import numpy as np

    rows = dict(result["settings"])
    if result.get("floor"):
        rows["floor"] = result["floor"]
    labels = list(rows)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 3, 4))
    for i, (name, key) in enumerate((("mean", CI_KEYS[0]), ("p99", "mismatch/logp_abs_diff_p99"))):
        vals = [rows[lab][key] for lab in labels]
        err = None
        if key == CI_KEYS[0] and all((rows[lab].get("ci95") or {}).get(key) for lab in labels):
            cis = np.array([rows[lab]["ci95"][key] for lab in labels])
            err = np.abs(cis.T - np.array(vals))
        ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, yerr=err, capsize=3, label=f"{name} |Δlogp|")
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel("|logp_train - logp_engine| (nats)")
    e = result["engine"]
    ax.set_title(f"{result['model']['model_type']} vs {e['name']} {e['version']} ({e['profile']}); 95% CI")
    ax.legend()
    fig.tight_layout()
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _abs_diff_plot(plt: Any, result: dict[str, Any], path: Path) -> None:
    import numpy as np

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
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


PLOTS = ("gaps.png", "abs_diff.png")
"""The plots :func:`write_plots` writes into the output directory."""


def write_plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``gaps.png`` (per-setting bars: mean with 95% CI, p99 |Δlogp|) and ``abs_diff.png`` (histogram + CDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars, hist = (out_dir / name for name in PLOTS)
    _gaps_plot(plt, result, bars)
    _abs_diff_plot(plt, result, hist)
    return [str(bars), str(hist)]
