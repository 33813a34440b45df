"""Word of an abort: where mpsrun's runner of a Python rank (:mod:`mpsrun.rank.pyrun`) tells the rank's supervisor
how the rank ends, before it calls MPI_Abort.

An MPI launcher ends every process of the job at an MPI_Abort, the supervisors too, before they could report the
rank's end: the job's summary then named a lost supervisor, often another rank's. The runner says it first, on a
socket in the session directory (a path, so no descriptor of mpsrun's reaches the rank), and waits for the word that
the job has heard it. Standard library only (the supervisor starts with ``python -S``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

from mpsrun.runtime.constants import ABORT_SOCKET_VARIABLE, KILL_WAIT, SOCKET_PATH_MOST

__all__ = ["AbortChannel"]


class AbortChannel:
    """The supervisor's end: a listening socket at ``path``, in the session directory."""

    def __init__(self, listener: socket.socket, path: str) -> None:
        self.listener, self.path = listener, path

    @classmethod
    def open(cls, session_dir: str, rank: int) -> AbortChannel | None:
        """Listen for rank ``rank``'s runner; None where no socket can be had (the rank's end is then reported when
        it comes, as any other's)."""
        path = os.path.join(session_dir, f"abort.{rank}.{os.getpid()}")
        if not session_dir or len(path.encode()) >= SOCKET_PATH_MOST:
            return None
        listener = socket.socket(socket.AF_UNIX)
        try:
            listener.bind(path)
            listener.listen(1)
        except OSError:
            listener.close()
            return None
        return cls(listener, path)

    @property
    def variables(self) -> dict[str, str]:
        """What the rank's runner needs to find the socket."""
        return {ABORT_SOCKET_VARIABLE: self.path}

    def notice(self, group: int | None) -> tuple[int | None, str, socket.socket | None] | None:
        """The runner's word (call when the socket is readable): the rank's exit code and why, and the connection to
        answer on once the job has heard it (:meth:`answer`). The socket is closed: one word is all there is. None
        for a connection from outside the rank's process ``group`` (another rank, a stranger: the session directory
        is theirs to reach), which is dropped unheard while the socket goes on listening."""
        code, reason, conn = None, "", None
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            if not _in_group(conn, group):
                conn.close()
                return None
            conn.settimeout(KILL_WAIT)
            number, _, reason = conn.recv(4096).decode(errors="replace").strip().partition(" ")
            code = int(number) if number.isdecimal() else None
        self.close()
        return code, reason, conn

    @staticmethod
    def answer(conn: socket.socket | None) -> None:
        """Let the runner go on to MPI_Abort."""
        if conn is not None:
            with contextlib.suppress(OSError), conn:
                conn.sendall(b"go\n")

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _in_group(conn: socket.socket, group: int | None) -> bool:
    """Whether the process at the other end of ``conn`` is one of the rank's (its process group's)."""
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    try:
        return group is not None and os.getpgid(pid) == group
    except OSError:
        return False
