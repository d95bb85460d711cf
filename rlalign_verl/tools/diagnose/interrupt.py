"""SIGINT / SIGTERM during ``diagnose``: unwind (stopping the engine child, removing temporary files) and exit
with one line, 130 / 143 as shells do, instead of a traceback or an orphaned engine."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by :func:`signals_as_interrupts` for the signal ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextmanager
def signals_as_interrupts(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block, the first of ``signums`` raises :class:`Interrupted` (so ``finally`` blocks and
    context managers run: the engine child is killed, temporary directories removed); later ones are
    ignored while that cleanup runs. Outside the main thread (where Python cannot set handlers): no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    before = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
