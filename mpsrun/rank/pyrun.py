"""``python -m mpsrun.rank.pyrun [FILE | -m MODULE | -c CODE] ARGS...``: a Python rank under mpi4py's runner rules.

mpi4py's runner (``python -m mpi4py``) calls ``MPI_Abort`` for an uncaught exception or ``sys.exit(N)``
instead of ``MPI_Finalize``, which waits forever for ranks that never come. Run bare, it also adds its
own and ``runpy``'s frames to every traceback, and a missing script becomes a 12-line traceback. This
runner keeps the abort and reports errors as ``python FILE`` does: the program's frames only, and one
line (exit code 2) for a script that cannot be opened. When the program imports ``mpi4py.MPI`` and rank 0
finds itself alone in its MPI world while the job has more ranks, it says why, once.

It runs in every Python rank's interpreter: what only a failure needs is imported when one comes.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpi4py.run import run_command_line, set_abort_status

from mpsrun.runtime.constants import ABORT_SOCKET_VARIABLE, WORLD_VARIABLE

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType, TracebackType

#: How long the runner waits for its supervisor to report the rank's end before it calls MPI_Abort.
ABORT_REPORT_WAIT = 10.0

__all__ = ["main"]

#: Where the frames of the running machinery come from (``<frozen runpy>`` on Python 3.11 and later).
_MACHINERY = {runpy.run_path.__code__.co_filename, run_command_line.__code__.co_filename, __file__}


def program_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the program's first frame on (None where the error came before the program ran)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _MACHINERY:
        tb = tb.tb_next
    return tb


def _program_only(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Python's hook, on the program's frames only (it reads the exception's own traceback)."""
    frames = program_frames(tb)
    sys.__excepthook__(kind, value.with_traceback(frames), frames)


def _unopenable(args: list[str], exc: BaseException) -> bool:
    """Whether ``exc`` says that the script itself could not be opened (Python's own exit code 2)."""
    return (isinstance(exc, OSError) and bool(args) and args[0] not in ("-m", "-c", "-")
            and exc.filename is not None and os.path.abspath(exc.filename) == os.path.abspath(args[0]))


def _before_abort(path: str, code: int, reason: str) -> None:
    """MPI_Abort is about to end every process of the job, the supervisor too: tell it how this rank ends (on its
    socket, :data:`ABORT_SOCKET_VARIABLE`), and wait (briefly) until the job has heard it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if not path or code == 0 or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    import contextlib
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as channel:
        channel.settimeout(ABORT_REPORT_WAIT)
        channel.connect(path)
        channel.sendall(f"{code} {reason}, then MPI_Abort\n".encode(errors="backslashreplace"))
        channel.recv(16)


def _said(exc: BaseException) -> str:
    """An uncaught exception in a few words: its type and the first line of its message."""
    lines = _text(exc, str).strip().splitlines()
    return f"uncaught {type(exc).__name__}" + (f": {lines[0][:200]}" if lines else "")


def _text(value: object, how: Callable[[object], str]) -> str:
    """``how(value)``, or "" where the program's own ``__str__`` or ``__repr__`` fails."""
    try:
        return how(value)
    except Exception:
        return ""


def _ending(exc: SystemExit | KeyboardInterrupt) -> tuple[int, str]:
    """The code MPI_Abort is to give (0: none) and the words for it. A code is a byte, as an exit status is, but never
    0 for a failure: ``sys.exit(256)`` would read as success (and a code past C's int failed in mpi4py)."""
    import signal

    from mpsrun.exitcodes import ExitCode, Outcome, exit_code

    if isinstance(exc, KeyboardInterrupt):
        return exit_code(Outcome("signal", signal.SIGINT)), "uncaught KeyboardInterrupt"
    if exc.code is None or exc.code == 0:
        return ExitCode.OK, ""
    if isinstance(exc.code, int):
        return (exc.code & 0xFF) or ExitCode.FAILED, f"sys.exit({exc.code})"
    return ExitCode.FAILED, f"sys.exit({_text(exc.code, repr)[:200]})"


class WorldWatch:
    """On ``sys.meta_path``, it finds no module itself: once the program has imported ``mpi4py.MPI`` (which starts
    MPI), rank 0 says whether it is alone in its MPI world while ``WORLD_SIZE`` says the job has more ranks (each
    rank then computes alone: an all-reduce of 2 ranks gave each its own value, and a failing rank's job exited 0).
    ``world``: who started the rank (:data:`WORLD_VARIABLE`)."""

    def __init__(self, world: str, size: int) -> None:
        self.world, self.size = world, size

    @classmethod
    def install(cls, world: str) -> None:
        """Watch in rank 0 of a job of several ranks (a check per import: one comparison, until MPI is imported)."""
        size = os.environ.get("WORLD_SIZE", "")
        if world and os.environ.get("RANK") == "0" and size.isdecimal() and int(size) > 1:
            sys.meta_path.insert(0, cls(world, int(size)))

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if name != "mpi4py.MPI":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)  # as the import would find it (this finder is off the path now)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_then_look(module: ModuleType) -> None:
                run(module)
                del loader.exec_module  # the loader's own again
                self._look(module)

            loader.exec_module = exec_then_look  # on this loader alone: the module's __loader__ stays the real one
        return spec

    def _look(self, mpi: ModuleType) -> None:
        try:
            alone = mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() == 1
            library = mpi.Get_library_version().strip().splitlines()[0][:80] if alone else ""
        except Exception:  # never the program's failure
            return
        if alone:
            from mpsrun.runtime.output import say

            say(f"mpsrun: rank 0 is alone in its MPI world (1 process, WORLD_SIZE={self.size}): {self._why(library)}")

    def _why(self, library: str) -> str:
        """The cause, and the way out."""
        if self.world == "mpi":
            return (f"mpi4py's MPI ({library}) is not the one whose launcher started the ranks; start them with "
                    "its mpiexec (--mpiexec PATH), or use an mpi4py built for the launcher's MPI")
        if self.world == "local":
            return (f"--launcher local starts each rank as an MPI world of its own; for one world of {self.size} "
                    "ranks, leave it out")
        return ("no mpiexec or mpirun is on PATH, so the local launcher started each rank as an MPI world of its "
                f"own; for one world of {self.size} ranks, put an MPI's mpiexec on PATH (pip install mpich)")


def main(args: list[str]) -> int:
    """Runs the program of ``args``; reports its uncaught exception as Python does; returns the exit code."""
    channel = os.environ.pop(ABORT_SOCKET_VARIABLE, "")  # not the program's, nor its children's
    WorldWatch.install(os.environ.pop(WORLD_VARIABLE, ""))
    try:
        run_command_line(args)
    except (SystemExit, KeyboardInterrupt) as exc:
        code, reason = _ending(exc)
        set_abort_status(code)
        _before_abort(channel, code, reason)
        # Python ends on an uncaught KeyboardInterrupt as by SIGINT (130), after its hook prints the traceback.
        sys.excepthook = _program_only
        raise
    except BaseException as exc:
        from mpsrun.exitcodes import ExitCode
        from mpsrun.runtime.output import say

        tb = program_frames(exc.__traceback__)
        if tb is None and _unopenable(args, exc):
            assert isinstance(exc, OSError)
            say(f"{sys.executable}: can't open file {os.path.abspath(args[0])!r}: [Errno {exc.errno}] {exc.strerror}")
            code = ExitCode.USAGE  # as Python says it
        else:
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the default hook reads the exception's own
            code = ExitCode.FAILED
        set_abort_status(code)
        _before_abort(channel, code, _said(exc))
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
