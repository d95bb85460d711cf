"""tests/support/wandb_offline.py reads back what ``wandb.log`` wrote in offline mode (no verl, no Ray, no network);
the framing test needs no wandb at all."""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import pytest
from wandb_offline import _payloads, history, offline_runs, records


@pytest.mark.slow  # wandb.init starts wandb-core, its service process: ~2 s idle, ~20 s on 2 busy cores
def test_an_offline_run_reads_back_every_key_at_its_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    logged = {
        1: {"mismatch/kl_k3": 0.1 + 0.2, "mismatch/num_tokens": 96.0, "mismatch/doctor/findings": 0.0},
        2: {"mismatch/kl_k3": 1e-17, "mismatch/verify/gain": 1.7734375, "mismatch/verify/verdict": -1.0},
        # a step far past the others, and a long key list that spans the log's 32 KiB blocks
        7: {f"mismatch/verify/ladder/k{i:04d}": i / 3 for i in range(2000)},
    }
    run = wandb.init(mode="offline", dir=str(tmp_path), project="rlalign-test", name="reader")
    try:
        for step, data in logged.items():
            run.log(data, step=step)
    finally:
        run.finish()
    files = offline_runs(tmp_path)
    assert len(files) == 1, files
    # finish() can return before wandb-core (a separate process) has written the exit record: on busy cores it
    # comes a moment later, so wait for it (a run that never gets one fails after the minute)
    deadline = time.monotonic() + 60
    while True:
        kinds = {r.WhichOneof("record_type") for r in records(files[0])}
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"run", "history", "exit"} <= kinds and files[0].stat().st_size > 32 * 1024, kinds
    read = history(files[0])
    assert sorted(read) == sorted(logged)
    for step, data in logged.items():
        assert read[step] == data, step  # exactly: the JSON of the same floats


def _log(*chunks: tuple[int, bytes]) -> bytes:
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for kind, data in chunks:
        crc = zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
        out += struct.pack("<IHB", crc, len(data), kind) + data
    return bytes(out)


def test_the_framing_joins_split_records_and_refuses_damage(tmp_path):
    path = Path(tmp_path / "run-x.wandb")
    assert list(_payloads(_log((1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")), path)) == [b"a", b"bcd"]
    damaged = bytearray(_log((1, b"abc")))
    damaged[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        list(_payloads(bytes(damaged), path))
    with pytest.raises(ValueError, match="not a wandb transaction log"):
        list(_payloads(b"PK\x03\x04" + bytes(10), path))
    # a record cut off by a crash: the whole ones before it are read
    assert list(_payloads(_log((1, b"a"), (1, b"bcdef"))[:-2], path)) == [b"a"]
