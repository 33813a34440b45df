"""The exit-code contract: the table, and the one function that turns a job's facts into its code.

0 every rank succeeded; otherwise the code of the rank that failed first (a rank killed by
signal N gives 128+N); 2 usage error; 3 set-up failure; 124 timeout; 126 not executable;
127 command not found; 128+N when mpsrun itself was stopped by signal N.

Every process of a job (the ``mpsrun`` command, a node keeper, each rank's supervisor) decides
its exit status with :func:`exit_code`, so the paths cannot disagree. Standard library only.
"""

from __future__ import annotations

import enum
import signal
from typing import NamedTuple

__all__ = ["CAUSES", "Cause", "ExitCode", "Outcome", "describe_returncode", "exit_code", "exit_status", "killed_by",
           "signal_name"]


class ExitCode:
    """Codes mpsrun gives for its own reasons (a failing rank gives its own code)."""

    OK = 0
    FAILED = 1  # a program's plain failure (Python's for an uncaught exception)
    USAGE = 2
    SETUP = 3
    TIMEOUT = 124
    NOT_EXECUTABLE = 126
    NOT_FOUND = 127
    KILLED = 128 + signal.SIGKILL  # a rank lost without a word: as if SIGKILLed


class Cause(str, enum.Enum):
    """Why a job ended, as its report's ``cause`` says. ``rank-failed``/``launcher-failed``: an :class:`Outcome`'s
    ``detail`` is the process's returncode (-N: killed by signal N; None: lost without a report); ``signal``: the
    signal's number; ``setup``/``check-failed``/``decided``: the code itself (``decided``: what the job's agent told a
    rank's supervisor); ``teardown-failed``: the job succeeded but its session could not be torn down."""

    OK = "ok"
    RANK_FAILED = "rank-failed"
    LAUNCHER_FAILED = "launcher-failed"
    TIMEOUT = "timeout"
    SIGNAL = "signal"
    CHECK_FAILED = "check-failed"
    SETUP = "setup"
    DECIDED = "decided"
    TEARDOWN_FAILED = "teardown-failed"

    def __str__(self) -> str:
        return self.value


CAUSES = tuple(cause.value for cause in Cause)


class Outcome(NamedTuple):
    """The facts a job's exit status is decided from: its first failure, and what came while it ended."""

    cause: str = Cause.OK
    detail: int | None = None
    teardown_failed: bool = False  # the session could not be torn down
    late_signal: int | None = None  # a stopping signal that came while the job was ending


def _shell(returncode: int) -> int:
    """A process's returncode as a shell reports it: killed by signal N (returncode -N) gives 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def exit_code(outcome: Outcome) -> int:
    """The exit status for ``outcome`` (the table in the module's docstring and in the README): the first
    failure's code; a job that succeeded but could not be torn down gives 3, one stopped while it ended 128+N."""
    code = _first_failure(outcome.cause, outcome.detail)
    if code == ExitCode.OK and outcome.teardown_failed:
        return ExitCode.SETUP
    if code == ExitCode.OK and outcome.late_signal:
        return 128 + outcome.late_signal
    return code


def _first_failure(cause: str, detail: int | None) -> int:
    try:
        known = Cause(cause)
    except ValueError:
        raise ValueError(f"unknown cause {cause!r}; one of {', '.join(CAUSES)}") from None
    if known is Cause.OK:
        return ExitCode.OK
    if known in (Cause.RANK_FAILED, Cause.LAUNCHER_FAILED):
        code = ExitCode.KILLED if detail is None else _shell(detail)
        return code or ExitCode.SETUP  # a launcher that ended 0 before its ranks ran still failed the job
    if known is Cause.TIMEOUT:
        return ExitCode.TIMEOUT
    if known is Cause.SIGNAL:
        return 128 + (detail or 0)
    return ExitCode.SETUP if detail is None else detail  # setup, check-failed, decided, teardown: the code itself


def exit_status(code: int) -> bool:
    """Whether ``code`` is an exit status a process can have (0-255)."""
    return 0 <= code <= 255


def killed_by(launcher_status: int, signal_offset: int | None) -> int | None:
    """The signal an MPI launcher says killed one of its processes, by its exit status and its way of saying it (it
    exits with ``signal_offset`` + S: Open MPI's 128); None where the status says no such thing."""
    number = launcher_status - signal_offset if signal_offset is not None else 0
    return number if 2 <= number < 65 else None


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number that names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_returncode(returncode: int) -> str:
    """``exited with code 7`` or ``was killed by signal 9 (SIGKILL)``."""
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode}"
