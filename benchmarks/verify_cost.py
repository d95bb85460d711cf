"""What the in-run verification costs: the extra (unaligned) pass as a share of the training step.

Runs the tiny CPU GRPO recipe (``recipes/grpo_tiny_cpu.sh``, all regions) with verification at every step, reads
verl's ``timing_s/step`` and the plugin's ``mismatch/verify/seconds`` per step from the run's JSONL, and prints
the single verify step's share and the share averaged over steps at cadence K (verify at step 1 and every K
steps: ``verify_s / (K * (step_s - verify_s) + verify_s)``), with the min-max over the measured steps.

Usage: python benchmarks/verify_cost.py [--steps 5] [--out runs/verify_cost] [--reuse]
Step 1 is reported apart (it includes warm-up); the cadence table uses steps >= 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CADENCES = (1, 5, 10, 20, 50)


def run(out: Path, steps: int) -> Path:
    env = dict(os.environ, ALIGN="all", STEPS=str(steps), OUT=str(out), PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "recipes" / "grpo_tiny_cpu.sh"), "alignment.verify.every=1"]
    subprocess.run(cmd, env=env, check=True)
    return out / "all.jsonl"


def shares(jsonl: Path) -> list[tuple[int, float, float]]:
    """``(step, step_s, verify_s)`` per logged step that verified."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        d = r["data"]
        if "mismatch/verify/seconds" in d and "timing_s/step" in d:
            out.append((int(r["step"]), float(d["timing_s/step"]), float(d["mismatch/verify/seconds"])))
    return out


def at_cadence(step_s: float, verify_s: float, k: int) -> float:
    """Share of training time spent verifying when one step in ``k`` verifies."""
    return verify_s / (k * (step_s - verify_s) + verify_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="runs/verify_cost")
    p.add_argument("--reuse", action="store_true", help="read an earlier run's JSONL instead of running")
    a = p.parse_args()
    out = Path(a.out).resolve()
    jsonl = out / "all.jsonl" if a.reuse else run(out, a.steps)
    measured = shares(jsonl)
    if len(measured) < 2:
        sys.exit(f"need >= 2 verify steps in {jsonl}, found {len(measured)}")
    print(f"{'step':>4} {'step_s':>8} {'verify_s':>9} {'share':>7}")
    for step, step_s, verify_s in measured:
        print(f"{step:>4} {step_s:>8.3f} {verify_s:>9.3f} {verify_s / step_s:>7.1%}")
    later = [(s, v) for step, s, v in measured if step >= 2]
    print("\nshare of training time at cadence K (steps >= 2: mean [min, max]):")
    for k in CADENCES:
        vals = [at_cadence(s, v, k) for s, v in later]
        print(f"  every={k:<3} {sum(vals) / len(vals):6.2%} [{min(vals):.2%}, {max(vals):.2%}]")


if __name__ == "__main__":
    main()
