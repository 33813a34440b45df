"""The one event loop: descriptors, timers and signals, waited on together, never slept through.

Standard library only (the rank shim imports it). A process that supervises others (the
launcher, a node keeper, a rank shim) registers what it waits for (a socket, a pidfd, a
pipe) and when (timers); signals arrive through the wake-up descriptor, so a handler never
runs in the middle of the process's own work.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from mpsrun.interrupts import catchable

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
        self._on_signal: Callable[[int], object] | None = None
        self._wakeup: int | None = None

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
        """Deliver these signals to ``callback`` from the loop while the block runs.

        Only the main thread can receive signals; elsewhere this does nothing.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous = {n: signal.signal(n, _record) for n in catchable(numbers)}
        old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._on_signal, self._wakeup = callback, read_end
        self.watch(read_end, self._read_signals)
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for number, handler in previous.items():
                signal.signal(number, handler)
            self.unwatch(read_end)
            self._on_signal = self._wakeup = None
            os.close(read_end)
            os.close(write_end)

    def _read_signals(self) -> None:
        assert self._wakeup is not None and self._on_signal is not None
        with contextlib.suppress(BlockingIOError):
            for number in os.read(self._wakeup, 512):
                self._on_signal(number)

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
        for key, _ in self._selector.select(wait):
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


def _record(number: int, frame: FrameType | None) -> None:
    """Signal handler: nothing to do here, the byte on the wake-up descriptor is the event."""
