"""A worker of :class:`mpsrun.farm.executor.Executor`: a spawned process that runs the calls its executor sends.

Each call comes as ``(number, pickled (function, args, kwargs))`` over the worker's connection (unpickled here, so a
function the worker cannot find is the call's error, not the worker's end) and its outcome goes back as
``(number, True, result)`` or ``(number, False, exception, traceback text)``, once the worker has said it took the
call (its ``number``); ``None`` ends the worker. The worker's GPU and MPS variables come with its start, and are put
in its environment before its first call, so before CUDA initialises. Light: the standard library, and mpsrun's
processes module.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

from mpsrun.runtime.processes import set_parent_death_signal

__all__ = ["RemoteTraceback", "serve"]


class RemoteTraceback(Exception):  # noqa: N818 - concurrent.futures' own name for it
    """The traceback of an exception raised in a worker, as its ``__cause__`` (as ProcessPoolExecutor does)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def serve(connection: Connection, env: Mapping[str, str], managed: Sequence[str], parent: int) -> None:
    """Put the worker's variables in its environment (``managed``: those of the caller's that mpsrun sets, taken
    out first), then run the calls that come until told to end (or the executor is gone). The worker dies with the
    executor's thread that started it (``parent``: the executor's process), also in the middle of a call."""
    set_parent_death_signal(signal.SIGKILL, parent)
    for name in managed:
        os.environ.pop(name, None)
    os.environ.update(env)
    # A Ctrl-C at the terminal reaches every worker: it interrupts the calls that run (their futures get the
    # KeyboardInterrupt), never an idle worker (it died, with a traceback, and failed the next call sent to it).
    while True:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (each time: a Ctrl-C may have cut the last reset short)
        try:
            work = connection.recv()
        except (EOFError, OSError):
            return
        if work is None:
            return
        number, call = work
        # A Ctrl-C that comes once the future shows running interrupts the call: it waits, blocked, until the call
        # can take it (it was lost while the call's function was still being unpickled).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        connection.send(number)  # taken: a worker that dies from now on dies running this call
        outcome: tuple[object, ...]
        try:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                function, args, kwargs = pickle.loads(call)  # noqa: S301 - our executor's own call: a function it cannot find is the call's error
                result = function(*args, **kwargs)
            finally:  # (before the traceback is written: a second Ctrl-C must not end the worker there)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            outcome = (number, True, result)
        except BaseException as exc:
            outcome = (number, False, _sendable(exc), "".join(traceback.format_exception(exc)))
        try:
            connection.send(outcome)
        except Exception as exc:  # the result cannot be pickled: the future gets why
            connection.send((number, False, TypeError(f"the call's outcome cannot be sent back: {exc}"),
                             "".join(traceback.format_exception(exc))))


def _sendable(exc: BaseException) -> BaseException:
    """``exc``, or where its pickle does not make it again (an ``__init__`` that takes other arguments than the
    exception's ``args``: it would fail in the executor's thread, as another error), one that says so."""
    try:
        pickle.loads(pickle.dumps(exc))  # noqa: S301 - what we have just pickled
    except Exception as why:
        return TypeError(f"the call's outcome cannot be sent back: {type(exc).__qualname__}: {exc}: {why}")
    return exc
