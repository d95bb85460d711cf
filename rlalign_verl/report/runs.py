"""One run's scalar series, read from verl's file-logger JSONL or a TensorBoard event directory, checked.

Nothing is plotted without a word: a step logged more than once (a resumed run: the last value is kept), a
value a key cannot take (a negative ``|Δ log p|``, a fraction outside [0, 1], NaN), an unreadable line and a
truncated event file are each named in :attr:`Run.problems`, which the command prints and the page shows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AlignmentError
from .tensorboard import read_scalars

SOURCES_HINT = (
    "expected verl's file-logger JSONL (trainer.logger=[...,file]; VERL_FILE_LOGGER_PATH or "
    "<VERL_FILE_LOGGER_ROOT>/<project>/<experiment>.jsonl) or a TensorBoard event directory "
    "(trainer.logger=[...,tensorboard]; TENSORBOARD_DIR or tensorboard_log/<project>/<experiment>)"
)

NON_NEGATIVE = (
    "mismatch/logp_abs_diff_",
    "mismatch/prob_abs_diff_",
    "mismatch/seq_log_ratio_abs_",
    "mismatch/kl_k2",
    "mismatch/kl_k3",
    "mismatch/ratio_",
    "mismatch/num_",
    "mismatch/nonfinite_tokens",
    "mismatch/verify/aligned",
    "mismatch/verify/unaligned",
    "mismatch/verify/gain",
    "mismatch/verify/num_",
    "mismatch/verify/ladder/",
)
"""Key prefixes whose values cannot be negative (absolute values, counts, ratios, k2/k3 KL estimators)."""
FRACTIONS = ("mismatch/ratio_clip_frac", "mismatch/verify/aligned_exact", "mismatch/verify/unaligned_exact")
VERDICTS = ("mismatch/verify/verdict",)


def impossible(key: str, value: float) -> str | None:
    """Why ``value`` cannot be a value of ``key`` (``None``: it can)."""
    if key in VERDICTS and value not in (-1.0, 0.0, 1.0):
        return "not a verdict (-1, 0, +1)"
    if key in FRACTIONS and not 0.0 <= value <= 1.0:
        return "a fraction outside [0, 1]"
    if value < 0 and any(key.startswith(p) for p in NON_NEGATIVE) and key not in FRACTIONS:
        return "negative, but it cannot be"
    return None


@dataclass
class Run:
    """A run's scalar series: ``series[key] = [(step, value), ...]`` sorted by step; what was wrong with it."""

    label: str
    source: str
    kind: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def last(self, key: str) -> float | None:
        points = self.series.get(key)
        return points[-1][1] if points else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None or not isinstance(value, int | float):
        return None
    return float(value)


def _clean(raw: dict[str, dict[int, list[float]]], problems: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Keep the last value of a step logged twice, drop impossible and non-finite values; say what happened."""
    series: dict[str, list[tuple[int, float]]] = {}
    repeated: set[int] = set()
    for key, by_step in raw.items():
        points, dropped = [], []
        for step, values in sorted(by_step.items()):
            if len(values) > 1:
                repeated.add(step)
            value = values[-1]
            why = "not finite" if not math.isfinite(value) else impossible(key, value)
            if why:
                dropped.append(f"{step} ({value:g}: {why})")
            else:
                points.append((step, value))
        if dropped:
            problems.append(
                f"{key}: dropped step(s) {', '.join(dropped[:5])}" + (" ..." if len(dropped) > 5 else "")
            )
        if points:
            series[key] = points
    if repeated:
        shown = ", ".join(str(s) for s in sorted(repeated)[:8]) + (" ..." if len(repeated) > 8 else "")
        problems.append(
            f"step(s) {shown} logged more than once (a resumed run?): the last value of each is plotted"
        )
    return series


def _load_jsonl(path: Path, problems: list[str]) -> dict[str, list[tuple[int, float]]]:
    raw: dict[str, dict[int, list[float]]] = {}
    good = bad = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise AlignmentError(f"{path} is not a text JSONL file (binary content); {SOURCES_HINT}") from None
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, data = int(row["step"]), row["data"]
            if not isinstance(data, dict):
                raise TypeError("data is not an object")
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        good += 1
        for key, value in data.items():
            number = _number(value)
            if number is not None:
                raw.setdefault(key, {}).setdefault(step, []).append(number)
    if good == 0:
        raise AlignmentError(f"{path}: no verl metrics lines ({bad} unreadable); {SOURCES_HINT}")
    if bad:
        problems.append(f"{bad} unreadable line(s) skipped (a truncated last line?)")
    return _clean(raw, problems)


def _load_tensorboard(directory: Path, problems: list[str]) -> dict[str, list[tuple[int, float]]]:
    events = read_scalars(directory)
    for item in events.truncated:
        problems.append(f"event file truncated ({item} unread): the steps written after it are missing")
    return _clean(events.series, problems)


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Load one run from a JSONL file, a directory holding one, or a TensorBoard event directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AlignmentError(f"run {path} does not exist; {SOURCES_HINT}")
    problems: list[str] = []
    if path.is_file():
        if path.name.startswith("events.out.tfevents"):
            return load_run(path.parent, label)
        series, kind = _load_jsonl(path, problems), "jsonl"
        default_label = path.stem
    else:
        event_dirs = sorted({p.parent for p in path.rglob("events.out.tfevents*") if p.is_file()})
        jsonl_files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if len(event_dirs) > 1:
            raise AlignmentError(
                f"{path} holds several TensorBoard runs ({', '.join(str(d) for d in event_dirs)}); pass one of them"
            )
        if event_dirs:
            series, kind = _load_tensorboard(event_dirs[0], problems), "tensorboard"
        elif len(jsonl_files) == 1:
            series, kind = _load_jsonl(jsonl_files[0], problems), "jsonl"
        elif jsonl_files:
            raise AlignmentError(
                f"{path} holds several JSONL files ({', '.join(p.name for p in jsonl_files)}); pass one of them"
            )
        else:
            raise AlignmentError(f"no verl metrics in {path}: it is empty or holds no run; {SOURCES_HINT}")
        default_label = path.name
    if not series:
        raise AlignmentError(f"{path}: no numeric metrics found; {SOURCES_HINT}")
    return Run(label=label or default_label, source=str(path), kind=kind, series=series, problems=problems)
