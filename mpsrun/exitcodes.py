"""The exit-code contract, in one table. Built-in modules only: every rank supervisor imports it.

0 every rank succeeded; otherwise the code of the rank that failed first (a rank killed by
signal N gives 128+N); 2 usage error; 3 set-up failure; 124 timeout; 126 not executable;
127 command not found; 128+N when mpsrun itself was stopped by signal N.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the stubs of ``signal`` describe it
    import signal as _signal
else:
    import _signal  # ``signal`` without its enums: ``signal`` and ``enum`` would cost every rank supervisor 5 ms

__all__ = ["ExitCode", "describe_returncode", "exit_code_of", "signal_name"]


class ExitCode:
    """Codes mpsrun gives for its own reasons (a failing rank gives its own code): plain ints."""

    OK = 0
    USAGE = 2
    SETUP = 3
    TIMEOUT = 124
    NOT_EXECUTABLE = 126
    NOT_FOUND = 127


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: a process killed by signal N (returncode -N) gives 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_names() -> dict[int, str]:
    """``SIGTERM`` for 15, as ``signal.Signals`` names them (an alias, such as SIGIOT or SIGCLD, yields)."""
    names: dict[int, str] = {}
    for name, number in sorted(vars(_signal).items()):
        signal = name.startswith("SIG") and not name.startswith("SIG_") and isinstance(number, int)
        if signal and (number not in names or name in ("SIGABRT", "SIGCHLD", "SIGIO")):
            names[number] = name
    return names


_SIGNAL_NAMES = _signal_names()


def signal_name(number: int) -> str:
    return _SIGNAL_NAMES.get(number, f"signal {number}")


def describe_returncode(returncode: int) -> str:
    """``exited with code 7`` or ``was killed by signal 9 (SIGKILL)``."""
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode}"
