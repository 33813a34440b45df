"""A session's reaper: ``python -m mpsrun.session.reaper SESSION_DIR OWNER_PID``, started with every session.

It waits on a pipe from the session's owner. An owner that closes its session says so
and the reaper exits. An owner that dies instead (SIGKILL, a crash, the OOM killer) only
closes the pipe: the reaper then stops the daemons and the rank process groups that
``session.json`` names (by pid and start time) and removes the directory. So a session's
daemons live exactly as long as its owner, whichever thread opened it, and nothing is left
behind even when ``mpsrun`` itself is killed.

Standard library only until there is work to do.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.processes import exit_now, python_without_site

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

__all__ = ["Reaper", "main"]

_CLOSED = b"closed"
#: Run first by the reaper's interpreter: a session that ends as it should costs its reaper an interpreter's start
#: and no more (mpsrun's modules are imported only when the owner died; ``main`` then reads the pipe's end).
_WAIT_FOR_OWNER = f"import os\nif sys.stdin.buffer.read() == {_CLOSED!r}:\n    os._exit({ExitCode.OK})"


class Reaper:
    """The owner's handle on its session's reaper."""

    def __init__(self, root: Path) -> None:
        self.process = subprocess.Popen(  # it imports nothing until its owner dies
            [*python_without_site("mpsrun.session.reaper", prelude=_WAIT_FOR_OWNER), str(root), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the owner's process group does not reach it
        )

    def release(self) -> None:
        """The owner closed its session itself: the reaper has nothing to do."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write(_CLOSED)
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: Sequence[str]) -> NoReturn:
    """Wait for the owner's word; reap the session if the owner died without it. Ends the process."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m mpsrun.session.reaper SESSION_DIR OWNER_PID", file=sys.stderr)
        os._exit(ExitCode.USAGE)
    if sys.stdin.buffer.read() == _CLOSED:
        exit_now(ExitCode.OK)  # the owner waits for this exit
    if sys.flags.no_site:  # started without site: its packages (psutil) are needed now
        import site

        site.main()
    from mpsrun.session.registry import reap  # the owner died: now the heavier imports are worth it

    # The pipe's end proves its owner gone, even before it wrote the record; a node session's directory may be
    # another owner's by now (its name is fixed), and is then left to that owner.
    reap(Path(argv[0]), force=True, owner=int(argv[1]))
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
