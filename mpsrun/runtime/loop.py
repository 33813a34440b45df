"""The one event loop: descriptors, timers and signals, waited on together, never slept through.

A process that supervises others (the launcher, a node keeper, a rank supervisor) registers what it
waits for (a socket, a pidfd, a pipe) and when (timers); signals arrive through the wake-up
descriptor, so a handler never runs in the middle of the process's own work.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import selectors
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from mpsrun.runtime.interrupts import catchable, restore_signals, take_signals

__all__ = ["EventLoop", "Timer"]


class Timer:
    """A callback due at a monotonic time; :meth:`cancel` stops it."""

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()
        self._noted: list[int] = []  # signals noted by signals()'s handler, not yet delivered

    @property
    def signal_noted(self) -> bool:
        """Whether a signal came that the loop has yet to deliver (for a callback that waits: it may stop waiting)."""
        return bool(self._noted)

    def watch(self, fd: int, callback: Callable[[], object]) -> None:
        """Call ``callback()`` whenever ``fd`` is readable (or at its end of file).

        A descriptor number still registered belongs to a file closed since: its number was
        reused, so the old registration is dropped (the kernel dropped it already).
        """
        self.unwatch(fd)
        self._selector.register(fd, selectors.EVENT_READ, callback)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)

    def after(self, seconds: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(time.monotonic() + seconds, callback)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    @contextlib.contextmanager
    def signals(self, numbers: Iterable[int], callback: Callable[[int], object]) -> Iterator[None]:
        """Deliver these signals to ``callback`` from the loop while the block runs (a handler only notes a
        signal; the byte on the wake-up descriptor wakes the loop). A signal noted after the loop's last look, up to
        the block's end, is delivered as the block ends (it was lost: a SIGTERM as a job's loop ended, while NVML
        shut down, left the job to exit 0). Only the main thread receives signals; elsewhere this does nothing."""
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        noted: list[int] = []  # taken by our handler, not yet delivered
        self._noted = noted

        def note(number: int, frame: FrameType | None) -> None:
            noted.append(number)

        previous = take_signals(catchable(numbers), note)
        try:
            if previous is None:
                yield
                return
            old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            self.watch(read_end, lambda: self._woken(read_end, noted, callback))
            try:
                yield
            finally:  # from here a signal is the old handlers' (one noted before is in ``noted``: never both)
                signal.set_wakeup_fd(old_wakeup)
                restore_signals(previous)
                self.unwatch(read_end)
            _deliver(noted, callback)
        finally:
            os.close(read_end)
            os.close(write_end)

    def _woken(self, fd: int, noted: list[int], callback: Callable[[int], object]) -> None:
        """A signal's wake-up: deliver what the handler noted (it runs a moment after the wake-up is written, in this
        thread: if it has yet to, on the loop's next turn)."""
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 512)
        if noted:
            _deliver(noted, callback)
        else:
            self.after(0, lambda: _deliver(noted, callback))

    def _due(self) -> Timer | None:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][2] if self._timers else None

    def run_once(self, max_wait: float | None = None) -> None:
        """Wait for the next event (at most ``max_wait`` seconds) and handle what is ready."""
        timer = self._due()
        wait = None if timer is None else max(0.0, timer.when - time.monotonic())
        if max_wait is not None:
            wait = max_wait if wait is None else min(wait, max_wait)
        # Rounded up to the millisecond, as epoll counts: a timer due in less is not spun on.
        timeout = None if wait is None else math.ceil(wait * 1e3) * 1e-3
        for key, _ in self._selector.select(timeout):
            if self._selector.get_map().get(key.fd) is key:  # not unwatched by an earlier callback of this turn
                key.data()
        now = time.monotonic()
        while (timer := self._due()) is not None and timer.when <= now:
            heapq.heappop(self._timers)
            timer.callback()

    def run_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.run_once()

    def close(self) -> None:
        self._selector.close()


def _deliver(noted: list[int], callback: Callable[[int], object]) -> None:
    while noted:
        callback(noted.pop(0))
