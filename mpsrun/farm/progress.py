"""A farm's progress for the user: tasks done, failed, running and left, the rate and the time left.

On a terminal it is one line that tqdm draws on stderr, below the tasks' output: a task's lines, as they are written,
first move the line aside (:meth:`Progress.__enter__`), which is drawn again after them. Elsewhere (a batch job's
log) it is a plain line now and then; under ``-q`` nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["PLAIN_INTERVAL", "Progress"]

#: Seconds between two plain progress lines (the output is no terminal).
PLAIN_INTERVAL = 60.0


class Progress:
    """Progress over ``total`` tasks, on ``stream``: drawn (a terminal), said now and then (``plain``), or not at
    all (``quiet``)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.total, self.stream = total, stream
        self.done = self.failed = self.running = 0
        self.began = time.monotonic()
        self.bar = None
        self.plain = not quiet and total > 0 and not stream.isatty()
        if not quiet and total > 0 and stream.isatty():
            from tqdm import tqdm  # only a farm on a terminal draws it

            sized = _columns(stream) > 0  # a terminal of no size (`script`'s, a test's): tqdm would
            self.bar = tqdm(total=total, unit="task", file=stream, leave=False, mininterval=0.2, desc="mpsrun",
                            dynamic_ncols=sized, **({} if sized else {"ncols": 80, "nrows": 24}))  # hide the line

    def __enter__(self) -> Progress:
        """A task's lines are about to be written: the line steps aside."""
        if self.bar is not None:
            self.bar.clear()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.refresh()

    def update(self, done: int, failed: int, running: int) -> None:
        """Where the farm stands: tasks finished (``failed`` of them failed) and running."""
        self.done, self.failed, self.running = done, failed, running
        if self.bar is not None:
            self.bar.set_postfix_str(f"{failed} failed, {running} running", refresh=False)
            self.bar.update(done - self.bar.n)

    def line(self) -> str:
        """The plain line: ``120 of 200 task(s) done (2 failed), 8 running, 72 left; 3.1 tasks/s, about 23 s left``."""
        left = self.total - self.done
        rate = self.done / max(time.monotonic() - self.began, 1e-3)
        eta = f", about {left / rate:.0f} s left" if rate > 0 and left else ""
        return (f"{self.done} of {self.total} task(s) done ({self.failed} failed), {self.running} running, {left} left;"
                f" {rate:.1f} tasks/s{eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to (0: it says none)."""
    with contextlib.suppress(OSError, ValueError):
        return os.get_terminal_size(stream.fileno()).columns
    return 0
