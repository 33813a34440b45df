"""SIGINT, SIGTERM and SIGHUP outside an event loop: one line and the documented exit code, never a traceback.

While a job is being set up, a stopping signal raises :class:`~mpsrun.errors.InterruptionError`, so
whatever was made so far is torn down by the same code that handles any failure; from then on (and
during teardown, see :meth:`Interrupts.deferred`) further signals are only remembered, so a teardown
with deadlines is never cut short. Inside an :class:`~mpsrun.runtime.loop.EventLoop` the loop's own
handling takes over and is restored after.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any

from mpsrun.errors import InterruptionError
from mpsrun.runtime.constants import STOP_SIGNALS

__all__ = ["Handler", "Interrupts", "catchable", "restore_signals", "take_signals", "uninterrupted"]

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
_active: list[Interrupts] = []  # the handlers in force, innermost last


def catchable(numbers: Iterable[int]) -> list[int]:
    """The signals this process may take over: one it inherited as ignored stays ignored (``nohup``)."""
    return [n for n in numbers if signal.getsignal(n) != signal.SIG_IGN]


def take_signals(numbers: Iterable[int], handler: Handler) -> dict[int, Handler] | None:
    """Install ``handler`` for each of ``numbers``; their previous handlers, or None outside the main thread
    (where Python delivers no signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {number: signal.signal(number, handler) for number in numbers}


def restore_signals(previous: dict[int, Handler]) -> None:
    for number, handler in previous.items():
        signal.signal(number, handler)


class Interrupts:
    """Handlers for the stopping signals while the block runs (in the main thread; elsewhere nothing)."""

    def __init__(self, deferred: bool = False) -> None:
        self.received: list[int] = []
        self.deferring = deferred  # True: every signal in the block is only remembered, up to its very end
        self._previous: dict[int, Handler] = {}
        self._thread: int | None = None  # the thread whose handlers these are, once in force

    def __enter__(self) -> Interrupts:
        previous = take_signals(catchable(STOP_SIGNALS), self._handle)
        if previous is not None:
            self._previous, self._thread = previous, threading.get_ident()
            _active.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        restore_signals(self._previous)
        if self in _active:
            _active.remove(self)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.received.append(sig)
        if not self.deferring:
            self.deferring = True  # the teardown this starts is not cut short by the next one
            raise InterruptionError(signal=sig)

    def defer_to_the_end(self) -> None:
        """Every signal from now to the block's end is only remembered (a teardown under way, and what follows it
        before the handlers go: a signal there was an error)."""
        self.deferring = True

    def in_force_here(self) -> bool:
        return self._thread == threading.get_ident()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals in the block are remembered in ``received``, not acted on."""
        before, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = before


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A stopping signal in the block is acted on as it ends, not inside it: a process being started there
    (``Popen`` cut short would lose it) is then on record, for the teardown to end it. In another thread than the
    one whose handlers are in force, this does nothing."""
    interrupts = _active[-1] if _active and _active[-1].in_force_here() else None
    if interrupts is None:
        yield
        return
    count = len(interrupts.received)
    with interrupts.deferred():
        yield
    if len(interrupts.received) > count and not interrupts.deferring:
        interrupts.deferring = True
        raise InterruptionError(signal=interrupts.received[count])
