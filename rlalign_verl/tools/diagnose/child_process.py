"""The engine child as a process: stopping it with everything it started, dying with its parent, and
the one line that says why it failed (its own last exception, not a generic hint)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from rlalign_verl.base.files import temp_names


def stop_child(proc: subprocess.Popen, outs: list[str]) -> None:
    """Kill the child's whole process group (not yet reaped, so its id is still its own) and wait for it;
    remove a dump it was writing (``write_rollouts`` writes a fresh ``.<name>.<random>.tmp``, then renames)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for out in outs:
        for tmp in temp_names(out):
            tmp.unlink(missing_ok=True)


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|KeyboardInterrupt)(:|$)")


_PYDANTIC_INPUT = re.compile(r"\s*\[type=[^\]]*input_value=.*?\]")
"""pydantic's ``[type=value_error, input_value=ArgsKwargs(...), input_type=...]`` after its message: noise."""


def failure_reason(log: str, returncode: int) -> str:
    """The engine's own reason, on one line: the final exception of the last traceback in the child's log
    (with its indented continuation, e.g. a pydantic ``Value error, ...``), else the last non-empty line;
    how it ended when a signal killed it."""
    lines = [ln.rstrip() for ln in log.splitlines()]
    start = max(
        (i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=-1
    )
    found = [i for i in range(max(start, 0), len(lines)) if _EXC_LINE.match(lines[i])]
    parts: list[str] = []
    if found:
        i = found[0] if start >= 0 else found[-1]
        parts.append(lines[i])
        for ln in lines[i + 1 :]:
            if not ln.startswith((" ", "\t")) or "errors.pydantic.dev" in ln:
                break
            parts.append(ln)
    else:
        parts = [ln for ln in lines if ln.strip()][-1:]
    reason = _PYDANTIC_INPUT.sub("", " ".join(" ".join(parts).split()))
    if len(reason) > 600:
        reason = reason[:600] + " ..."
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = " (out of memory?)" if returncode == -signal.SIGKILL else ""
        return f"killed by {name}{why}" + (f" after: {reason}" if reason else "")
    return reason or f"exit {returncode} without a message"


def import_failed(reason: str) -> bool:
    """The child could not import vLLM (a broken install): the install hint is the fix."""
    return ("No module named" in reason or reason.startswith("ImportError")) and "vllm" in reason.lower()


def die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when the process that started it dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)
