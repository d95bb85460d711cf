"""Where ``diagnose`` and ``report`` write: directories the user named, checked before anything is written,
never followed through a link.

:func:`open_out_dir` refuses a directory path that is a symbolic link, creates the directory, opens it with
``O_NOFOLLOW`` and probes that a file can be created in it (``os.access`` says yes to root on a read-only file
system). :meth:`OutDir.check` refuses target names that are links, directories or other non-regular files
before the first write; :meth:`OutDir.write` writes each file to a fresh temporary name (``O_CREAT | O_EXCL |
O_NOFOLLOW``) relative to the opened directory and renames it over the target, so nothing is ever written
through a link, even one planted after the check. :func:`prepare_out_dir` / :func:`atomic_target` are the same
rules for writers that take a path (diagnose's plots and dumps): a file is written to a temporary name in its
target directory and renamed over the target, so a reader never sees half a file and a symlink at the target
is replaced, never followed. Every refusal is one :class:`~rlalign_verl.base.errors.AlignmentError` line naming
the fix.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rlalign_verl.base.errors import AlignmentError

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_NEW_FILE_FLAGS = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


class OutDir:
    """An output directory opened without following links; files are written relative to its descriptor."""

    def __init__(self, path: Path, fd: int, flag: str) -> None:
        self.path = path
        self.fd = fd
        self.flag = flag

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check(self, names: list[str]) -> None:
        """Refuse (one line) any target that exists and is not a regular file: a link is never replaced."""
        for name in names:
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise AlignmentError(
                    f"{self.flag} {self.path / name} cannot be checked ({_reason(err)}); pass another directory"
                ) from None
            if stat.S_ISLNK(st.st_mode):
                target = _link_target(self.path / name)
                raise AlignmentError(
                    f"{self.flag} {self.path / name} is a symbolic link (to {target}): rlalign-verl writes "
                    "nothing through a link; remove the link or pass another directory"
                )
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise AlignmentError(
                    f"{self.flag} {self.path / name} is {kind}, where rlalign-verl writes a file; "
                    "remove it or pass another directory"
                )

    def write(self, name: str, data: bytes) -> Path:
        """Write ``data`` to a new temporary file here and rename it over ``name`` (a link is replaced,
        never followed); one-line error when the disk refuses."""
        tmp = temp_name(name).name
        try:
            fd = os.open(tmp, _NEW_FILE_FLAGS, 0o666, dir_fd=self.fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as err:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise AlignmentError(
                f"{self.flag} {self.path / name} could not be written ({_reason(err)}); "
                "pass a writable directory with free space"
            ) from None
        return self.path / name


def open_out_dir(out: str | Path, flag: str = "--out") -> OutDir:
    """Create (if needed) and open the directory ``out``; one-line error if it is a link, a file, under a
    file, or not writable. Nothing outside ``out`` is created except its missing parents."""
    _named(out, flag, "a directory path")
    path = Path(out)
    if path.is_symlink():
        raise AlignmentError(
            f"{flag} {path} is a symbolic link (to {_link_target(path)}): rlalign-verl writes nothing "
            "through a link; pass the real directory path"
        )
    if path.exists() and not path.is_dir():
        raise AlignmentError(f"{flag} {path} is a file, not a directory; pass a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise AlignmentError(
            f"{flag} {path} lies under a file, not a directory; pass a directory path"
        ) from None
    except OSError as err:
        raise AlignmentError(
            f"{flag} {path} cannot be created ({_reason(err)}); pass a writable directory"
        ) from None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as err:  # replaced by a link (ELOOP / ENOTDIR) since the check, or not searchable
        raise AlignmentError(
            f"{flag} {path} cannot be opened as a directory without following a link ({_reason(err)}); "
            "pass a real, accessible directory"
        ) from None
    out_dir = OutDir(path, fd, flag)
    probe = f".rlalign-write-probe-{secrets.token_hex(6)}"
    try:
        os.close(os.open(probe, _NEW_FILE_FLAGS, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
    except OSError as err:
        out_dir.close()
        raise AlignmentError(
            f"{flag} {path} is not writable ({_reason(err)}); pass a writable directory"
        ) from None
    return out_dir


def prepare_out_dir(out: str | Path, flag: str = "--out", names: tuple[str, ...] = ()) -> Path:
    """:func:`open_out_dir`'s checks for a writer that takes paths: ``out`` exists afterwards, is a real,
    writable directory and not a link, and none of the files ``names`` it will write there is a link, a
    directory or another non-regular file (:meth:`OutDir.check`); one-line error otherwise."""
    with open_out_dir(out, flag) as out_dir:
        out_dir.check(list(names))
    return Path(out)


def _named(value: str | Path, flag: str, what: str) -> None:
    """An empty path (an unset shell variable) is refused: it would mean the current directory."""
    if not str(value).strip():
        raise AlignmentError(f"{flag} is empty; pass {what}")


def open_log(path: str | Path, flag: str = "--out") -> IO[str]:
    """``path`` opened for writing text (created or truncated) without following a link at it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        why = (
            "a symbolic link: rlalign-verl writes nothing through a link"
            if Path(path).is_symlink()
            else _reason(err)
        )
        raise AlignmentError(
            f"{flag}: {path} cannot be written ({why}); remove it or pass another directory"
        ) from None
    return os.fdopen(fd, "w")


def check_file_target(target: str | Path, flag: str) -> Path:
    """A file the run will write: not a directory, its parent creatable and writable."""
    _named(target, flag, "a file path")
    path = Path(target)
    if path.is_dir():
        raise AlignmentError(f"{flag} {path} is a directory; pass a file path")
    prepare_out_dir(path.parent, flag=f"{flag} (parent of {path.name})")
    return path


def temp_name(target: str | Path) -> Path:
    """A fresh name next to ``target`` for :func:`atomic_target`: ``.<name>.<random>.tmp``
    (:func:`temp_names` finds them)."""
    target = Path(target)
    return target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")


def temp_names(target: str | Path) -> list[Path]:
    """The temporary files :func:`atomic_target` may have left next to ``target`` (a writer killed mid-write)."""
    target = Path(target)
    return sorted(target.parent.glob(f".{glob_escape(target.name)}.*.tmp"))


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


@contextmanager
def atomic_target(target: str | Path) -> Iterator[Path]:
    """Yield a new temporary path next to ``target`` (created exclusively, never through a link, with the mode a new
    file gets under the umask); on success it is renamed over ``target``."""
    tmp = temp_name(target)
    os.close(os.open(tmp, _NEW_FILE_FLAGS, 0o666))
    try:
        yield tmp
        os.replace(tmp, target)  # replaces a symlink at target itself; never writes through it
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_text(target: str | Path, text: str) -> Path:
    """Atomically write ``text`` to ``target``."""
    with atomic_target(target) as tmp:
        tmp.write_text(text)
    return Path(target)
