"""A progress line with a live elapsed-time counter, for steps without a count (engine, build)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stage(desc: str) -> Iterator[None]:
    """Show ``desc: <elapsed>`` on stderr while the block runs, then ``done``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed} {postfix}", leave=True, file=sys.stderr)
    stop = threading.Event()

    def tick() -> None:
        # a live clock on a terminal only: in a log file every refresh would be another line
        while not stop.wait(1.0):
            if sys.stderr.isatty():
                bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
        bar.set_postfix_str("done")
    finally:
        stop.set()
        t.join()
        bar.update(1)
        bar.close()
