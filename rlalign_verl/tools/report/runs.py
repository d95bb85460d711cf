"""One run's scalar series, read from verl's file-logger JSONL or a TensorBoard event directory, checked.

Nothing is plotted or dropped without a word: a step logged more than once (a resumed run: the last value is
kept), a value a key cannot take (a negative ``|Δ log p|``, a fraction outside [0, 1], NaN), an unreadable
line (not JSON, a key given twice, ...), a number logged as text (read as the number), a value that is no
number (skipped), a 95% interval that is partial or does not hold its value (dropped, the point kept), a
truncated event file and a run without any ``mismatch/*`` series are each named in :attr:`Run.problems`,
which the command prints and the page shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.tools.report.jsonl import read_jsonl
from rlalign_verl.tools.report.tensorboard import is_run_event_file, read_scalars

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
BANDS: dict[str, tuple[str, str]] = {
    "mismatch/verify/gain": ("mismatch/verify/gain_lo", "mismatch/verify/gain_hi")
}
"""Key -> the keys of its 95% interval (low, high), drawn around each of its points."""


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
    check_bands(series, problems, {k: {s: len(v) for s, v in by_step.items()} for k, by_step in raw.items()})
    return series


def _band_problem(
    key: str, step: int, value: dict[int, float], lo: dict[int, float], hi: dict[int, float], logged: dict
) -> str | None:
    """Why the interval of ``key`` at ``step`` cannot be drawn around its value (``None``: it can)."""
    name = key.rsplit("/", 1)[-1]
    if step not in value:
        return f"no usable {name} at that step"
    if step not in lo or step not in hi:
        return f"no usable {name}_{'lo' if step not in lo else 'hi'}"
    counts = [logged.get(k, {}).get(step) for k in (key, *BANDS[key])]
    if len(set(counts)) > 1:
        return f"{name} logged {counts[0]}×, {name}_lo {counts[1]}×, {name}_hi {counts[2]}× (a resumed run?)"
    if not lo[step] <= hi[step]:
        return f"interval [{lo[step]:g}, {hi[step]:g}] reversed"
    if not lo[step] <= value[step] <= hi[step]:
        return f"{name} {value[step]:g} outside [{lo[step]:g}, {hi[step]:g}]"
    return None


def check_bands(
    series: dict[str, list[tuple[int, float]]],
    problems: list[str],
    logged: dict[str, dict[int, int]] | None = None,
) -> None:
    """Drop each interval (:data:`BANDS`) that is partial or does not hold its value; say which and why.

    ``logged``: key -> step -> how many times the step was logged (a step logged again without its interval
    pairs a value with another log line's interval). The point itself stays, drawn without its interval.
    """
    for key, (lo_key, hi_key) in BANDS.items():
        value, lo, hi = (dict(series.get(k, [])) for k in (key, lo_key, hi_key))
        why = {s: _band_problem(key, s, value, lo, hi, logged or {}) for s in sorted({*lo, *hi})}
        bad = {s: w for s, w in why.items() if w}
        if not bad:
            continue
        for k in (lo_key, hi_key):
            kept = [(s, v) for s, v in series.get(k, []) if s not in bad]
            if kept:
                series[k] = kept
            else:
                series.pop(k, None)
        shown = "; ".join(f"step {s}: {w}" for s, w in list(bad.items())[:5]) + (
            " ..." if len(bad) > 5 else ""
        )
        problems.append(
            f"{key}: 95% interval dropped at {len(bad)} step(s), each point drawn without it: {shown}"
        )


def _values_problem(table: dict[str, tuple[int, str]], what: str) -> str | None:
    """One line for the values of ``table`` (key -> (count, example)): mismatch/* keys named first."""
    if not table:
        return None
    keys = sorted(table, key=lambda k: (not k.startswith("mismatch/"), k))
    shown = ", ".join(f"{k} ×{table[k][0]} (e.g. {table[k][1]})" for k in keys[:6])
    more = f" and {len(keys) - 6} more key(s)" if len(keys) > 6 else ""
    return f"{sum(n for n, _ in table.values())} {what}: {shown}{more}"


def _load_jsonl(path: Path, problems: list[str], seen: set[str]) -> dict[str, list[tuple[int, float]]]:
    found = read_jsonl(path)
    seen.update(found.series, found.text_numbers, found.non_numeric)
    bad = found.bad_lines
    if found.lines == 0:
        why = ", ".join(f"line {n}: {w}" for n, w in bad[:3]) + (" ..." if len(bad) > 3 else "")
        said = f"{len(bad)} unreadable: {why}" if bad else "the file is empty or blank"
        raise AlignmentError(f"{path}: no verl metrics lines ({said}); {SOURCES_HINT}")
    if found.cut_short:
        problems.append(
            f"the last line ({bad[0][0]}) is cut short (a run still writing, or killed mid-write?): skipped"
        )
    elif bad:
        shown = ", ".join(f"line {n} ({w})" for n, w in bad[:5]) + (" ..." if len(bad) > 5 else "")
        problems.append(f"{len(bad)} unreadable line(s) skipped: {shown}")
    if found.not_utf8:
        shown = ", ".join(str(n) for n in found.not_utf8[:5]) + (" ..." if len(found.not_utf8) > 5 else "")
        problems.append(f"line(s) {shown} hold bytes that are not UTF-8: read with those bytes replaced")
    for table, what in (
        (found.text_numbers, "value(s) logged as text were read as numbers"),
        (found.non_numeric, "non-numeric value(s) skipped"),
    ):
        line = _values_problem(table, what)
        if line:
            problems.append(line)
    return _clean(found.series, problems)


def _load_tensorboard(
    directory: Path, problems: list[str], seen: set[str]
) -> dict[str, list[tuple[int, float]]]:
    events = read_scalars(directory)
    seen.update(events.series, events.non_numeric)
    for item in events.truncated:
        problems.append(
            f"event file truncated or corrupt ({item} unread): the steps written after it are missing"
        )
    for item in events.damaged:
        problems.append(
            f"event file damaged ({item} failing their checksum): their values are skipped, not plotted"
        )
    line = _values_problem(events.non_numeric, "non-numeric value(s) under scalar tags skipped")
    if line:
        problems.append(line)
    return _clean(events.series, problems)


def _mismatch_remark(series: dict[str, list[tuple[int, float]]], seen: set[str], problems: list[str]) -> None:
    """Say so when the run has no usable mismatch/* series: the headline plots would be empty."""
    if any(k.startswith("mismatch/") for k in series):
        return
    if any(k.startswith("mismatch/") for k in seen):
        problems.append(
            "no usable mismatch/* value in this run: every one was dropped (see the remarks above)"
        )
    else:
        problems.append(
            "no mismatch/* metrics in this run: was alignment.metrics on, and was the rlalign-verl plugin "
            "loaded in the trainer?"
        )


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Load one run from a JSONL file, a directory holding one, or a TensorBoard event directory."""
    path = Path(path).expanduser()
    try:
        return _load_run(path, label)
    except OSError as err:  # a file or directory of the run that cannot be read: one line, not a traceback
        where = err.filename or path
        raise AlignmentError(
            f"run {path}: {where} cannot be read ({err.strerror or type(err).__name__}); make it readable "
            "or pass another run"
        ) from None


def _load_run(path: Path, label: str | None) -> Run:
    if path.is_symlink() and not path.exists():
        raise AlignmentError(f"run {path} is a broken symbolic link (or a link loop); pass the run itself")
    if not path.exists():
        raise AlignmentError(f"run {path} does not exist; {SOURCES_HINT}")
    problems: list[str] = []
    seen: set[str] = set()  # every key logged, usable or not
    if path.is_file():
        if is_run_event_file(path):
            return _load_run(path.parent, label)
        series, kind = _load_jsonl(path, problems, seen), "jsonl"
        default_label = path.stem
    elif path.is_dir():
        event_dirs = sorted({p.parent for p in path.rglob("events.out.tfevents*") if is_run_event_file(p)})
        jsonl_files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if len(event_dirs) > 1:
            raise AlignmentError(
                f"{path} holds several TensorBoard runs ({', '.join(str(d) for d in event_dirs)}); pass one of them"
            )
        if event_dirs:
            series, kind = _load_tensorboard(event_dirs[0], problems, seen), "tensorboard"
            if jsonl_files:
                problems.append(
                    f"the TensorBoard events were read; {path} also holds {jsonl_files[0].name}: pass that file "
                    "to read it instead"
                )
        elif len(jsonl_files) == 1:
            series, kind = _load_jsonl(jsonl_files[0], problems, seen), "jsonl"
        elif jsonl_files:
            raise AlignmentError(
                f"{path} holds several JSONL files ({', '.join(p.name for p in jsonl_files)}); pass one of them"
            )
        else:
            raise AlignmentError(f"no verl metrics in {path}: it is empty or holds no run; {SOURCES_HINT}")
        default_label = path.name
    else:
        raise AlignmentError(f"run {path} is neither a file nor a directory; {SOURCES_HINT}")
    if not series:
        said = f" ({'; '.join(problems)})" if problems else ""
        raise AlignmentError(f"{path}: no numeric metrics found{said}; {SOURCES_HINT}")
    _mismatch_remark(series, seen, problems)
    return Run(label=label or default_label, source=str(path), kind=kind, series=series, problems=problems)
