"""The one event loop: descriptors, timers and signals, waited on together, never slept through.

Built-in modules only (every rank supervisor imports it). A process that supervises others (the
launcher, a node keeper, a rank shim) registers what it waits for (a socket, a pidfd, a
pipe) and when (timers); signals arrive through the wake-up descriptor, so a handler never
runs in the middle of the process's own work.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import select
import time

from mpsrun.runtime.interrupts import catchable, restore_signals, take_signals

TYPE_CHECKING = False  # imported by every rank supervisor: typing's and collections' imports are left out
if TYPE_CHECKING:  # the stubs of ``signal`` describe ``_signal``: ``signal`` without its enums (5 ms per supervisor)
    import signal as _signal
    from collections.abc import Callable, Iterable
    from types import FrameType, TracebackType

    from mpsrun.runtime.interrupts import Handler
else:
    import _signal

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
    """epoll, timers and the signal wake-up descriptor (epoll itself rather than ``selectors``: 3 ms less per
    rank supervisor)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], object]] = {}
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
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def unwatch(self, fd: int) -> None:
        if self._callbacks.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):  # closed since: the kernel dropped it
                pass

    def after(self, seconds: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(time.monotonic() + seconds, callback)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    def signals(self, numbers: Iterable[int], callback: Callable[[int], object]) -> SignalDelivery:
        """Deliver these signals to ``callback`` from the loop while the block runs.

        Only the main thread can receive signals; elsewhere this does nothing.
        """
        return SignalDelivery(self, numbers, callback)

    def _read_signals(self) -> None:
        assert self._wakeup is not None and self._on_signal is not None
        try:
            numbers = os.read(self._wakeup, 512)
        except BlockingIOError:
            return
        for number in numbers:
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
        for callback in self._ready(wait):
            callback()
        now = time.monotonic()
        while (timer := self._due()) is not None and timer.when <= now:
            heapq.heappop(self._timers)
            timer.callback()

    def _ready(self, wait: float | None) -> list[Callable[[], object]]:
        """The callbacks of the descriptors ready within ``wait`` seconds (None: no limit), as ``selectors`` waits:
        rounded up to the millisecond, so a timer due in less is not spun on."""
        timeout = -1.0 if wait is None else math.ceil(wait * 1e3) * 1e-3 if wait > 0 else 0.0
        try:
            events = self._epoll.poll(timeout, max(len(self._callbacks), 1))
        except InterruptedError:
            return []
        return [self._callbacks[fd] for fd, _ in events if fd in self._callbacks]

    def run_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.run_once()

    def close(self) -> None:
        self._epoll.close()


class SignalDelivery:
    """The block of :meth:`EventLoop.signals`: handlers that only note the signal, a byte on the wake-up
    descriptor that the loop reads."""

    def __init__(self, loop: EventLoop, numbers: Iterable[int], callback: Callable[[int], object]) -> None:
        self.loop, self.numbers, self.callback = loop, list(numbers), callback
        self.previous: dict[int, Handler] | None = None

    def __enter__(self) -> None:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            old_wakeup = _signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signals here
            os.close(read_end)
            os.close(write_end)
            return
        self.previous = take_signals(catchable(self.numbers), _record)
        self.pipe, self.old_wakeup = (read_end, write_end), old_wakeup
        self.loop._on_signal, self.loop._wakeup = self.callback, read_end
        self.loop.watch(read_end, self.loop._read_signals)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.previous is None:
            return
        _signal.set_wakeup_fd(self.old_wakeup)
        restore_signals(self.previous)
        self.loop.unwatch(self.pipe[0])
        self.loop._on_signal = self.loop._wakeup = None
        os.close(self.pipe[0])
        os.close(self.pipe[1])


def _record(number: int, frame: FrameType | None) -> None:
    """Signal handler: nothing to do here, the byte on the wake-up descriptor is the event."""
