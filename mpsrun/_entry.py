"""The ``mpsrun`` command's entry point: it takes the stopping signals before anything else is imported.

Between the interpreter's start and the job's own signal handling lie tens of milliseconds of
imports; a Ctrl-C there would otherwise print a ``KeyboardInterrupt`` traceback. Here a signal
is only noted, and :func:`mpsrun.cli.main` then ends with one line and 128+N.
"""

import signal

_pending: list[int] = []


def _note(number: int, frame: object) -> None:
    _pending.append(number)


for _number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_number) is not signal.SIG_IGN:  # inherited as ignored (nohup): stays ignored
        signal.signal(_number, _note)


def main() -> int:
    from mpsrun.cli import main as command

    return command(pending=_pending)
