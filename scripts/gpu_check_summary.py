#!/usr/bin/env python
"""A compact summary of ``gpu_profile_check.py`` JSON reports, for the end of the device command's output.

The device tool returns only the last 12,000 characters of a command's output, and the full table of a
bundle run is longer, so ``scripts/gpu_device_check.sh`` ends with this: one line per (region, profile)
with the rows' worst bit-identical fraction and, for every row whose ``best`` rounding variant is not the
profile's own, that variant; the e2e rows with their intervals; the MoE router rows; every problem; and
the verdict. A report that is missing (a step that timed out or crashed) is a failure::

    python scripts/gpu_check_summary.py $OUT/gpu_check.json $OUT/gpu_check_e2e.json

Exit 0 when every report exists and passes, else 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def row_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (region, profile): rows, worst identical %, worst ULP, and the misses' best variants."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["region"], r["profile"]), []).append(r)
    out = []
    for (region, profile), rs in groups.items():
        errors = [r for r in rs if r.get("error")]
        done = [r for r in rs if r.get("result")]
        worst = min((r["result"]["identical"] for r in done), default=None)
        ulp = max((r["result"]["max_ulp"] for r in done), default=None)
        text = f"{region:<12} {profile:<10} {len(rs):>3} rows"
        if worst is not None:
            text += f"  min identical {100 * worst:8.3f}%  max_ulp {ulp}"
        if errors:
            text += f"  {len(errors)} ERROR(s), first: {errors[0]['error'][:120]}"
        best = sorted({f"{r['best'][0]} ({100 * r['best'][1]:.3f}%)" for r in done if _missed(r)})
        if best:
            text += f"  MISS best: {'; '.join(best[:3])}"
        out.append(text)
    return out


def _missed(row: dict[str, Any]) -> bool:
    best = row.get("best")
    return bool(best) and best[1] - row["result"]["identical"] > 1e-6


def e2e_lines(e2e: dict[str, Any] | None) -> list[str]:
    """The e2e rows of each floor mode (bundle mode: ``runs``; an installed engine: one report)."""
    if not e2e:
        return []
    runs = e2e.get("runs") or ({e2e.get("profile", "?"): e2e} if e2e.get("rows") else {})
    out = []
    for engine, run in runs.items():
        for label, row in run.get("rows", {}).items():
            lo, hi = row["ci95"]["mismatch/logp_abs_diff_mean"]
            out.append(
                f"e2e {engine:<10} [{run.get('floor', 'floor')}, {run.get('profile')}] {label:<8} "
                f"{row['mean_abs_dlogp']:.4f} [{lo:.4f}, {hi:.4f}]"
            )
    return out


def moe_lines(moe: dict[str, Any] | None) -> list[str]:
    """The MoE rows (fractions bit-identical), one line per case."""
    if not moe:
        return []
    out = []
    for key, rows in moe.items():
        if isinstance(rows, dict):
            cells = ", ".join(f"{name} {100 * v:.3f}%" for name, v in rows.items())
            out.append(f"moe {key}: {cells}")
        elif key != "misses":
            out.append(f"moe {key}: {rows}")
    return out


def summarize(paths: list[Path]) -> tuple[str, bool]:
    """``(text, passed)`` for the reports at ``paths``."""
    lines, passed = [], True
    for path in paths:
        lines.append(f"== {path.name}")
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            lines.append(f"FAIL no report: {type(exc).__name__}: {exc} (the step crashed or timed out)")
            passed = False
            continue
        if report.get("status") != "ran":
            lines.append(f"FAIL the check did not run: {report.get('reason', report.get('status'))}")
            passed = False
            continue
        lines += row_lines(report.get("rows", []))
        lines += e2e_lines(report.get("e2e")) + moe_lines(report.get("moe"))
        for name, why in (report.get("profiles_unavailable") or {}).items():
            lines.append(f"absent {name}: {why[:200]}")
        lines += [f"FAIL {p}" for p in report.get("problems", [])]
        lines.append(
            f"verdict {report.get('verdict')} ({report.get('seconds')} s, device {report.get('device')})"
        )
        passed = passed and report.get("verdict") == "pass"
    lines.append("gpu check: " + ("pass" if passed else "FAIL"))
    return "\n".join(lines), passed


def main(argv: list[str] | None = None) -> int:
    """Print the summary of the reports named on the command line; 0 when all pass."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: gpu_check_summary.py REPORT.json [...]", file=sys.stderr)
        return 2
    text, passed = summarize([Path(a) for a in args])
    print(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
