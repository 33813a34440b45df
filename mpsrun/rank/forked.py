"""A rank supervisor forked from the local launcher: the supervisor's own code, with no interpreter to start.

Starting ``python -m mpsrun.rank`` costs an interpreter start and its imports per rank, on the
path of every job; a fork of the controller has both already. The child is made to look like
a freshly started supervisor before it runs :func:`mpsrun.rank.cli.main`: a session of its own,
only descriptors 0-2 (stdin from ``/dev/null`` unless it is given the terminal), the signals
the controller caught back at their defaults (ignored ones stay ignored, as across exec), and
the job's environment. It never returns into the controller's code: it ends with ``os._exit``.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Mapping, Sequence

from mpsrun.exitcodes import ExitCode
from mpsrun.rank.cli import main  # imported once, here: every forked supervisor has it
from mpsrun.runtime.constants import FORWARDED_SIGNALS
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import exit_now, flush_output, set_parent_death_signal, wait

__all__ = ["ForkedSupervisor"]



class ForkedSupervisor:
    """The part of :class:`subprocess.Popen` the launchers use (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], stdin: bool) -> None:
        flush_output()  # what is buffered is the parent's to write, not the child's
        self.returncode: int | None = None
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            code: int = ExitCode.SETUP
            try:
                code = _become_supervisor(list(args), env, stdin, parent)
            except OSError as exc:  # the machine's refusal (too many open files, say): one line
                say(f"mpsrun: error: a rank's supervisor could not run: {exc}")
            except BaseException:  # a bug: said in full; the child then ends like a supervisor that failed
                traceback.print_exc()
            finally:
                exit_now(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = wait(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = wait(self.pid)
        assert self.returncode is not None
        return self.returncode


def _become_supervisor(args: list[str], env: Mapping[str, str], stdin: bool, parent: int) -> int:
    signal.set_wakeup_fd(-1)  # the controller's loop is not ours: a signal here must not wake it
    for number in FORWARDED_SIGNALS:  # every signal the controller may catch
        if signal.getsignal(number) not in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(number, signal.SIG_DFL)
    os.setsid()
    set_parent_death_signal(signal.SIGTERM, parent)  # as a started supervisor gets it: the controller gone, stop
    if not stdin:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the controller's sockets, pipes and pidfds stay the controller's
    os.environ.clear()
    os.environ.update(env)
    return main(args)
