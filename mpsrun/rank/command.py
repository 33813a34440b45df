"""How a rank's command is run: a Python rank under mpi4py's runner rules, and what a failed exec means.

Standard library only (the supervisor starts with ``python -S``).
"""

from __future__ import annotations

import errno
import os
import sys

from mpsrun.exitcodes import ExitCode

__all__ = ["PYRUN", "exec_failure_code", "through_mpi4py"]


def exec_failure_code(exc: OSError) -> int:
    """The program could not be found (127) or executed (126: also an argument list too long), as a shell says it;
    or the machine refused to start it (too many open files or processes, no memory): a set-up failure (3)."""
    if isinstance(exc, FileNotFoundError):
        return ExitCode.NOT_FOUND
    if isinstance(exc, PermissionError) or exc.errno in (errno.ENOEXEC, errno.EISDIR, errno.ENOTDIR, errno.ELOOP,
                                                         errno.E2BIG):
        return ExitCode.NOT_EXECUTABLE
    return ExitCode.SETUP


#: The runner of Python ranks (a module: the rank's interpreter finds mpsrun where it finds mpi4py).
PYRUN = "mpsrun.rank.pyrun"


def through_mpi4py(command: list[str], program: str) -> list[str]:
    """``python x.py``, ``python -m mod``, ``python -c code`` as ``python -m mpsrun.rank.pyrun ...``.

    That runner (:mod:`mpsrun.rank.pyrun`) keeps mpi4py's rule, MPI_Abort for an uncaught exception or
    ``sys.exit(N)`` (only if the program imported MPI) instead of MPI_Finalize, which waits forever for
    ranks that never come, and reports errors as ``python x.py`` does. Only this interpreter is known to
    have mpi4py and mpsrun (the controller checked); other commands run as given.
    """
    if os.path.realpath(program) != os.path.realpath(sys.executable) or len(command) < 2:
        return command
    first = command[1]
    interpreter_option = first.startswith("-") and first not in ("-m", "-c")  # -u, -X, -: left alone
    if interpreter_option or command[1:3] in (["-m", "mpi4py"], ["-m", PYRUN]):
        return command
    return [command[0], "-m", PYRUN, *command[1:]]
