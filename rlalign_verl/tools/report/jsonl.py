"""verl's file-logger JSONL (``{"step": N, "data": {key: value}}`` per line), read without silent loss.

- Encoding: a byte-order mark (UTF-8, UTF-16, UTF-32) is honoured, so the first line parses; bytes that are
  not UTF-8 (a Latin-1 text value) are replaced and the line's numbers still read, the line is named. A BOM
  at the start of a later line (files concatenated) is dropped too.
- Lines: split on ``\\n`` only (a JSON string may hold U+2028 and friends, which ``str.splitlines`` would
  split on); each unreadable line is counted with its number and why (not JSON, a key given twice in one
  object such as two ``step`` keys, no whole-number step, ...).
  Only a last line cut short is blamed on truncation.
- Values: a number is read as is; ``null`` is verl's NaN/inf (orjson writes non-finite floats as null) and
  is read as NaN, so the run's checks name the step it drops; a string holding a number (``"0.05"``,
  ``"nan"``) is read as that number and said; anything else (text, a list, an object, a boolean) is
  counted per key and said.
"""

from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlalign_verl.base import strict_json
from rlalign_verl.base.errors import AlignmentError

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),  # before UTF-16 LE: its BOM starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
    (codecs.BOM_UTF8, "utf-8-sig"),
)


@dataclass
class JsonlScalars:
    """What :func:`read_jsonl` found: the values per key and step, and every value or line it could not use."""

    series: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    lines: int = 0
    """Lines read as verl metrics lines."""
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    """``(line number, why)`` of each line skipped."""
    not_utf8: list[int] = field(default_factory=list)
    """Numbers of the lines holding bytes that are not UTF-8 (read with U+FFFD in their place)."""
    cut_short: bool = False
    """The only bad line is the last one, not JSON, with no newline after it: a write cut short."""
    text_numbers: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Key -> (count, example) of numbers logged as strings (read as numbers)."""
    non_numeric: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Key -> (count, example) of values that are not numbers (skipped)."""


def short(value: Any, width: int = 32) -> str:
    """``repr(value)``, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _count(table: dict[str, tuple[int, str]], key: str, example: str) -> None:
    count, first = table.get(key, (0, example))
    table[key] = (count + 1, first)


def _decode(path: Path, data: bytes, result: JsonlScalars) -> list[str]:
    """The file's lines as text; the numbers of lines holding bytes that are not UTF-8 go to ``result``."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data.decode(encoding, errors="replace").split("\n")
    if b"\x00" in data:
        raise AlignmentError(
            f"{path} is not a text JSONL file (binary content, or UTF-16 without a byte-order mark); "
            "pass verl's file-logger JSONL (UTF-8)"
        )
    lines: list[str] = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:  # e.g. a Latin-1 byte in a text value: the line's numbers still count
            lines.append(raw.decode("utf-8", errors="replace"))
            result.not_utf8.append(number)
    return lines


MAX_STEP = 10**9
"""The largest step read: a training run is far shorter, and a stray 1e300 would squash every real point."""


def _step(value: Any) -> int | None:
    """A whole-number step from 0 to :data:`MAX_STEP` (``3``, ``3.0``, ``"3"``: ASCII digits, as verl writes them);
    ``None`` for anything else (``"1_0"``, other scripts' digits, negative or huge steps)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[0-9]+(\.0*)?", text):  # int() would read "1_0" as 10 and Arabic-Indic digits
            return None
        value = int(text.split(".")[0])
    if isinstance(value, float):
        value = int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, int) and 0 <= value <= MAX_STEP:
        return value
    return None


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range: infinite, and dropped as such by the checks
        return math.inf if value > 0 else -math.inf


def _row(text: str) -> tuple[int, dict[str, Any]] | str:
    """``(step, data)`` of one line, or why it is unreadable."""
    try:
        row = strict_json.loads(text)
    except strict_json.DuplicateKeyError as dup:
        return f"key {short(dup.key)} given twice in one object"
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(row, dict) or "step" not in row or "data" not in row:
        return "not a verl metrics line (no step and data)"
    step = _step(row["step"])
    if step is None:
        return f"step {short(row['step'], 16)} is not a whole number from 0 to {MAX_STEP:.0e}"
    if not isinstance(row["data"], dict):
        return "data is not an object"
    return step, row["data"]


def _add(result: JsonlScalars, step: int, key: str, value: Any) -> None:
    if value is None:  # orjson (verl's file logger) writes NaN and ±inf as null
        number = math.nan
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = _as_float(value)
    elif isinstance(value, str) and value.strip():
        try:
            number = float(value.strip())
        except ValueError:
            _count(result.non_numeric, key, f"{short(value)} at step {step}")
            return
        _count(result.text_numbers, key, f"{short(value)} at step {step}")
    else:
        _count(result.non_numeric, key, f"{short(value)} at step {step}")
        return
    result.series.setdefault(key, {}).setdefault(step, []).append(number)


def read_jsonl(path: Path) -> JsonlScalars:
    """Read one JSONL file; :class:`AlignmentError` (one line) when it cannot be read at all."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise AlignmentError(
            f"run {path} cannot be read ({err.strerror or type(err).__name__}); make it readable or pass another run"
        ) from None
    result = JsonlScalars()
    lines = _decode(path, data, result)
    last = max((i for i, line in enumerate(lines) if line.strip("\ufeff \t\r")), default=-1)
    for index, line in enumerate(lines):
        text = line.lstrip("\ufeff").strip()
        if not text:
            continue
        parsed = _row(text)
        if isinstance(parsed, str):
            result.bad_lines.append((index + 1, parsed))
            continue
        result.lines += 1
        step, values = parsed
        for key, value in values.items():
            _add(result, step, str(key), value)
    result.cut_short = (
        len(result.bad_lines) == 1
        and result.bad_lines[0] == (last + 1, "not JSON")
        and last == len(lines) - 1  # no newline after it
    )
    return result
