"""Reading a wandb offline run back from its files, with wandb's own record schema.

``wandb.init(mode="offline", dir=D)`` writes ``D/wandb/offline-run-<time>-<id>/run-<id>.wandb``: wandb's
transaction log, a LevelDB-style log of ``wandb_internal.Record`` protobufs. wandb 0.31 has no Python reader
of it (``wandb sync`` and the store live in the Go ``wandb-core``), so this reads the framing here (the
7-byte file header ``:W&B`` + magic ``0xBEE1`` + version, then 32 KiB blocks of CRC32-checked chunks:
FULL, or FIRST/MIDDLE.../LAST) and parses every record with ``wandb.proto.wandb_internal_pb2.Record``.
:func:`history` gives ``{step: {key: value}}`` from the run's history records (the ``_step`` of each
``wandb.log``), as a dashboard would chart them.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["history", "offline_runs", "records"]

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_IDENT, _MAGIC = b":W&B", 0xBEE1
_CHUNK = struct.Struct("<IHB")  # crc32 (of type byte + data), length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The ``run-*.wandb`` files of the offline runs under ``wandb_dir`` (the ``dir=`` / ``WANDB_DIR``)."""
    return sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))


def _payloads(data: bytes, path: Path) -> Iterator[bytes]:
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than a wandb log header")
    ident, magic, _version = _HEADER.unpack_from(data)
    if ident != _IDENT or magic != _MAGIC:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[: _HEADER.size]!r})")
    pos, parts = _HEADER.size, []
    while pos < len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK.size:  # the block's zero padding
            pos += left_in_block
            continue
        if pos + _CHUNK.size > len(data):
            break
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero fill at the end of a block (or of an unfinished file)
            pos += left_in_block
            continue
        start = pos + _CHUNK.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            break  # a record cut off by a crash: everything before it is whole
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: checksum mismatch at byte {pos}")
        pos = start + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            yield b"".join([*parts, chunk])
            parts = []
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")


def records(path: Path) -> Iterator[Any]:
    """Every ``wandb_internal.Record`` of one ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    path = Path(path)
    for payload in _payloads(path.read_bytes(), path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _value(item: Any) -> Any:
    kind = item.WhichOneof("value")
    if kind is None:
        return json.loads(item.value_json)
    if kind == "json":
        return json.loads(item.json)
    if kind == "none":
        return None
    return getattr(item, kind)


def history(path: Path) -> dict[int, dict[str, Any]]:
    """``{step: {key: value}}`` from the history records of one run (``_step`` and the other ``_*`` keys left out)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = _value(item)
        step = int(row.pop("_step", record.history.step.num))
        steps.setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return steps
