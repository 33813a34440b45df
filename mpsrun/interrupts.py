"""SIGINT, SIGTERM and SIGHUP outside an event loop: one line and the documented exit code, never a traceback.

Standard library only (the rank shim imports it). While a job is being set up, a stopping
signal raises :class:`InterruptionError`, so whatever was made so far is torn down by the same code
that handles any failure; from then on (and during teardown, see :meth:`Interrupts.deferred`)
further signals are only remembered, so a teardown with deadlines is never cut short. Inside
an :class:`~mpsrun.loop.EventLoop` the loop's own handling takes over and is restored after.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType, TracebackType

from mpsrun.errors import MPSError
from mpsrun.exitcodes import signal_name

__all__ = ["InterruptionError", "Interrupts", "catchable", "uninterrupted"]

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_active: list[Interrupts] = []  # the handlers in force, innermost last


def catchable(numbers: Iterable[int]) -> list[int]:
    """The signals this process may take over: one it inherited as ignored stays ignored (``nohup``)."""
    return [n for n in numbers if signal.getsignal(n) is not signal.SIG_IGN]


class InterruptionError(MPSError):
    """mpsrun was stopped by a signal (exit 128+N). Attribute: ``signal``."""

    signal: int

    def __init__(self, message: str = "", *, signal: int = 0) -> None:
        super().__init__(message or f"interrupted by {signal_name(signal)}", signal=signal)
        self.exit_code = 128 + signal


class Interrupts:
    """Handlers for the stopping signals while the block runs (in the main thread; elsewhere nothing)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.deferring = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in catchable(STOPPING)}
            _active.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if self in _active:
            _active.remove(self)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.received.append(sig)
        if not self.deferring:
            self.deferring = True  # the teardown this starts is not cut short by the next one
            raise InterruptionError(signal=sig)

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
    (``Popen`` cut short would lose it) is then on record, for the teardown to end it."""
    if not _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupts = _active[-1]
    count = len(interrupts.received)
    with interrupts.deferred():
        yield
    if len(interrupts.received) > count and not interrupts.deferring:
        interrupts.deferring = True
        raise InterruptionError(signal=interrupts.received[count])
