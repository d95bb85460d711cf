"""Where ``rlalign-verl report`` writes: only inside the directory named (``--out`` or
``--tensorboard-layout``), never through a symbolic link, with a one-line error before the first byte when
the target is a link, a file, a directory where a file goes, or not writable.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from report_runs import call

HEADLINE = "mismatch/logp_abs_diff_mean"


@pytest.fixture
def run_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"step": s, "data": {HEADLINE: 0.01 * s}}) + "\n" for s in (1, 2)))
    return path


def _refused(capsys: pytest.CaptureFixture[str], rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("[rlalign-verl] ERROR AlignmentError: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("flag", ["--out", "--tensorboard-layout"])
def test_a_directory_that_is_a_link_is_refused(tmp_path, capsys, run_file, flag):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    argv = [str(run_file), "--out", str(link)] if flag == "--out" else [flag, str(link)]
    _refused(capsys, call(*argv), f"{flag} {link} is a symbolic link", "pass the real directory path")
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize("flag", ["--out", "--tensorboard-layout"])
def test_a_dangling_link_is_refused_as_a_link(tmp_path, capsys, run_file, flag):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "not-yet")
    argv = [str(run_file), "--out", str(link)] if flag == "--out" else [flag, str(link)]
    _refused(capsys, call(*argv), "is a symbolic link")
    assert not (tmp_path / "not-yet").exists()


def test_a_report_file_that_is_a_link_is_refused_before_any_write(tmp_path, capsys, run_file):
    secret = tmp_path / "secret.html"
    secret.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").symlink_to(secret)
    _refused(capsys, call(str(run_file), "--out", str(out)), f"{out / 'report.html'} is a symbolic link")
    assert secret.read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["report.html"] and (out / "report.html").is_symlink()


def test_a_directory_where_a_report_file_goes_is_refused(tmp_path, capsys, run_file):
    out = tmp_path / "out"
    (out / "logp_gap.png").mkdir(parents=True)
    _refused(capsys, call(str(run_file), "--out", str(out)), "logp_gap.png is a directory", "remove it")
    assert sorted(p.name for p in out.iterdir()) == ["logp_gap.png"]


def test_layout_into_an_existing_file_is_refused(tmp_path, capsys):
    target = tmp_path / "events.txt"
    target.write_text("x")
    _refused(capsys, call("--tensorboard-layout", str(target)), "is a file, not a directory")
    _refused(capsys, call("--tensorboard-layout", str(target / "sub")), "lies under a file")
    assert target.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 directory")
@pytest.mark.parametrize("flag", ["--out", "--tensorboard-layout"])
def test_a_read_only_directory_is_refused(tmp_path, capsys, run_file, flag):
    target = tmp_path / "ro"
    target.mkdir(mode=0o555)
    argv = [str(run_file), "--out", str(target)] if flag == "--out" else [flag, str(target)]
    _refused(capsys, call(*argv), "is not writable", "pass a writable directory")


@pytest.mark.parametrize("flag", ["--out", "--tensorboard-layout"])
def test_a_read_only_file_system_is_refused_even_for_root(tmp_path, capsys, run_file, monkeypatch, flag):
    """``os.access`` says yes to root: the probe file is what finds a read-only mount."""
    target = tmp_path / "ro"
    target.mkdir()
    real_open = os.open

    def read_only(path, flags, *args, dir_fd=None, **kw):  # noqa: ANN001 - os.open's own signature
        if flags & os.O_CREAT and (dir_fd is not None or str(target) in os.fspath(path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args, dir_fd=dir_fd, **kw)

    monkeypatch.setattr(os, "open", read_only)
    argv = [str(run_file), "--out", str(target)] if flag == "--out" else [flag, str(target)]
    _refused(capsys, call(*argv), "is not writable (Read-only file system)")
    assert not any(target.iterdir())


def test_a_full_disk_leaves_no_temporary_file(tmp_path, capsys, run_file, monkeypatch):
    out = tmp_path / "out"
    real_write = os.write
    calls = {"n": 0}

    def full(fd, data):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    _refused(capsys, call(str(run_file), "--out", str(out)), "could not be written (No space left on device)")
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
