"""SIGINT, SIGTERM and SIGHUP outside an event loop: one line and the documented exit code, never a traceback.

Built-in modules only (every rank supervisor imports it). While a job is being set up, a stopping
signal raises :class:`InterruptionError`, so whatever was made so far is torn down by the same code
that handles any failure; from then on (and during teardown, see :meth:`Interrupts.deferred`)
further signals are only remembered, so a teardown with deadlines is never cut short. Inside
an :class:`~mpsrun.runtime.loop.EventLoop` the loop's own handling takes over and is restored after.
"""

from __future__ import annotations

import _thread

from mpsrun.errors import MPSError
from mpsrun.exitcodes import signal_name

TYPE_CHECKING = False  # imported by every rank supervisor: typing's and collections' imports are left out
if TYPE_CHECKING:  # the stubs of ``signal`` describe ``_signal``: ``signal`` without its enums (5 ms per supervisor)
    import signal as _signal
    from collections.abc import Callable, Iterable
    from types import FrameType, TracebackType
    from typing import Any

    Handler = Callable[[int, FrameType | None], Any] | int | None
else:
    import _signal

__all__ = ["InterruptionError", "Interrupts", "catchable", "uninterrupted"]

STOPPING = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
_active: list[Interrupts] = []  # the handlers in force, innermost last


def catchable(numbers: Iterable[int]) -> list[int]:
    """The signals this process may take over: one it inherited as ignored stays ignored (``nohup``)."""
    return [n for n in numbers if _signal.getsignal(n) != _signal.SIG_IGN]


def take_signals(numbers: Iterable[int], handler: Handler) -> dict[int, Handler] | None:
    """Install ``handler`` for each of ``numbers``; their previous handlers, or None outside the main thread
    (where Python delivers no signals)."""
    previous: dict[int, Handler] = {}
    try:
        for number in numbers:
            previous[number] = _signal.signal(number, handler)
    except ValueError:  # not the main thread: signal() refuses before changing anything
        return None
    return previous


def restore_signals(previous: dict[int, Handler]) -> None:
    for number, handler in previous.items():
        _signal.signal(number, handler)


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
        self.thread: int | None = None  # the thread whose handlers these are, once in force
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> Interrupts:
        previous = take_signals(catchable(STOPPING), self._handle)
        if previous is not None:
            self._previous, self.thread = previous, _thread.get_ident()
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

    def deferred(self) -> Deferred:
        """Signals in the block are remembered in ``received``, not acted on."""
        return Deferred(self)


class Deferred:
    """The block of :meth:`Interrupts.deferred` (a class, not a generator: ``contextlib``'s imports are left out)."""

    def __init__(self, interrupts: Interrupts) -> None:
        self.interrupts = interrupts
        self.before = False  # the state the block restores, read as it is entered

    def __enter__(self) -> None:
        self.before, self.interrupts.deferring = self.interrupts.deferring, True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.interrupts.deferring = self.before


class uninterrupted:  # noqa: N801 - used as a function: ``with uninterrupted():``
    """A stopping signal in the block is acted on as it ends, not inside it: a process being started there
    (``Popen`` cut short would lose it) is then on record, for the teardown to end it. In another thread than the
    main one, whose handlers are in ``_active``, this does nothing."""

    def __enter__(self) -> None:
        self.interrupts = _active[-1] if _active and _active[-1].thread == _thread.get_ident() else None
        if self.interrupts is not None:
            self.count = len(self.interrupts.received)
            self.deferred = self.interrupts.deferred()
            self.deferred.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        interrupts = self.interrupts
        if interrupts is None:
            return
        self.deferred.__exit__(kind, exc, tb)
        if len(interrupts.received) > self.count and not interrupts.deferring and kind is None:
            interrupts.deferring = True
            raise InterruptionError(signal=interrupts.received[self.count])
