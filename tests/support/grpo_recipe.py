"""Running ``recipes/grpo_tiny_cpu.sh`` from the GRPO tests: its environment, a local run, its JSONL rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"


def rows(path: Path) -> list[dict]:
    """verl's file-logger JSONL: one ``{"step": k, "data": {...}}`` per step."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recipe_env(**knobs: str) -> dict[str, str]:
    """This interpreter's environment with the recipe's knobs (a large learning rate: the policy moves)."""
    env = dict(os.environ, PYTHON=sys.executable, LR="1e-3", **knobs)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_recipe(out: Path, overrides: list[str], **knobs: str) -> subprocess.CompletedProcess:
    """One local arm of the recipe (``ALIGN``, ``STEPS``, ... as knobs), verl overrides after it."""
    env = recipe_env(OUT=str(out), **knobs)
    cmd = ["bash", str(ROOT / "recipes" / "grpo_tiny_cpu.sh"), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def tool_agent(loop: str = "tool_agent") -> tuple[dict[str, str], list[str]]:
    """Knobs and overrides of a two-round tool-calling rollout (``tests/support/tiny_tool_agent.py``): verl's agent
    ``loop`` with the ``tiny_calls`` parser and the ``lookup`` function tool (whose file loads the other two into
    each agent-loop worker), responses of 48 tokens."""
    knobs = {"RESPONSE_LEN": "48"}
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        f"{rollout}.agent.default_agent_loop={loop}",
        f"{rollout}.multi_turn.format=tiny_calls",
        f"{rollout}.multi_turn.function_tool_path={SUPPORT / 'tiny_function_tools.py'}",
        f"{rollout}.multi_turn.max_assistant_turns=2",
    ]
    return knobs, overrides
