"""Output files of ``diagnose``/``report``: checked before any work, written atomically inside ``--out``.

A file is written to a temporary name in its target directory and renamed over the target, so a
reader never sees half a file and a symlink at the target is replaced, never followed out of ``--out``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import AlignmentError


def prepare_out_dir(out: str | Path, flag: str = "--out") -> Path:
    """Create ``out`` (a directory) and check it is writable; one-line error otherwise."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise AlignmentError(f"{flag} {path} is a file, not a directory; pass a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise AlignmentError(
            f"{flag} {path} lies under a file, not a directory; pass a directory path"
        ) from None
    except PermissionError:
        raise AlignmentError(
            f"{flag} {path} cannot be created (permission denied); pass a writable directory"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise AlignmentError(f"{flag} {path} is not writable; pass a writable directory")
    return path


def check_file_target(target: str | Path, flag: str) -> Path:
    """A file the run will write: not a directory, its parent creatable and writable."""
    path = Path(target)
    if path.is_dir():
        raise AlignmentError(f"{flag} {path} is a directory; pass a file path")
    prepare_out_dir(path.parent, flag=f"{flag} (parent of {path.name})")
    return path


@contextmanager
def atomic_target(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is renamed over ``target``."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)  # replaces a symlink at target itself; never writes through it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(target: str | Path, text: str) -> Path:
    """Atomically write ``text`` to ``target``."""
    with atomic_target(target) as tmp:
        tmp.write_text(text)
    return Path(target)
