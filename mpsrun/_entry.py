"""The ``mpsrun`` command's entry point: it takes the job's signals before anything else is imported.

Between the interpreter's start and the job's own signal handling lie tens of milliseconds of
imports; a Ctrl-C there would otherwise print a ``KeyboardInterrupt`` traceback. Here a signal
is only noted, and :func:`mpsrun.cli.main` then ends with one line and 128+N.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from mpsrun.runtime.constants import PASS_SIGNALS, STOP_SIGNALS

_pending: list[int] = []


def _note(number: int, frame: object) -> None:
    _pending.append(number)


def _drop(number: int, frame: object) -> None:
    """SIGUSR1/SIGUSR2 before the job's loop forwards them: no rank to pass them to yet (their default would end
    mpsrun). A handler, not SIG_IGN, which the ranks would inherit."""


for _number, _handler in [*((n, _note) for n in STOP_SIGNALS), *((n, _drop) for n in PASS_SIGNALS)]:
    if signal.getsignal(_number) is not signal.SIG_IGN:  # inherited as ignored (nohup): stays ignored
        signal.signal(_number, _handler)


def main() -> NoReturn:
    """Run the command and end the process with its exit status.

    By then everything mpsrun started has ended and been reaped, and the session is gone; the
    interpreter's own finalisation (hundreds of modules) would add tens of milliseconds to every
    job, so the process ends at once, once its output is flushed.
    """
    from mpsrun.mps.gpus import kept_until_exit
    from mpsrun.runtime.processes import exit_now, open_standard_descriptors

    open_standard_descriptors()
    kept_until_exit()
    from mpsrun.cli import main as command

    before = len(_pending)
    try:
        code = command(pending=_pending)
        # Written out here, not at the exit: whether a gone reader is seen must not depend on buffering (block-
        # buffered, the whole output waited for the exit's flush, where an error goes unseen: exit 0, not 141).
        sys.stdout.flush()
    except BrokenPipeError:  # our output's reader left (mpsrun doctor --json | head): end as a shell's command does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit has nowhere else to go
        from mpsrun.exitcodes import Outcome, exit_code

        code = exit_code(Outcome("signal", signal.SIGPIPE))
    except OSError as exc:  # what the machine refused that no step said better (mpsrun status > /dev/full)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is left unwritten goes nowhere
        from mpsrun.exitcodes import ExitCode
        from mpsrun.runtime.output import printable, say

        say(f"mpsrun: error: {exc.strerror or exc}" + (f": {printable(str(exc.filename))}" if exc.filename else ""))
        code = ExitCode.SETUP
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # from here on a signal comes as if after our exit
    if code == 0 and len(_pending) > before:  # after the job's own handling gave the signals back to _note
        from mpsrun.exitcodes import Outcome, exit_code, signal_name
        from mpsrun.runtime.output import say

        say(f"mpsrun: interrupted by {signal_name(_pending[before])} while ending the job")  # as during teardown
        code = exit_code(Outcome("signal", _pending[before]))
    exit_now(code)
