"""The mpiexec launcher's head start: ``mpiexec`` starts first, the rest of the job while it does.

An MPI launcher takes hundreds of milliseconds to start its ranks (Open MPI's ``mpirun``: about
0.3 s on the GPU test machine), and until this module, mpsrun started it last: after importing
its machinery, finding the GPUs and starting the MPS daemons. Now, once the command line is read,
the job's session directory is made, its control socket bound, and mpiexec started; the GPUs,
the daemons and the controller come up meanwhile. The rank supervisors' connections wait in the
socket's backlog, and each gets its welcome (its GPU, its MPS pipe directory) once the daemons
answer, exactly as before: no rank runs its command before then.

If the job cannot start after all (no GPU, MPS required but unavailable, a daemon that does not
answer, an interrupt), :meth:`HeadStart.abandon` kills mpiexec's process group before the error
is reported, and removes the directory: nothing is left. Only the single-host mpiexec launcher
gets a head start; ``--hosts`` relays through node keepers over TCP.
"""

from __future__ import annotations

import contextlib
import os
import signal

import attrs

from mpsrun.backends import Backend, HostsBackend, Launched, MpiexecBackend
from mpsrun.errors import MPSError
from mpsrun.options import JobConfig
from mpsrun.paths import SessionDirs, session_base
from mpsrun.protocol import Listener, control_env, new_token

__all__ = ["HeadStart", "head_start"]


@attrs.define
class HeadStart:
    """An mpiexec started before its job's session; the job takes it over (:meth:`hand_over`) or drops it."""

    dirs: SessionDirs
    listener: Listener
    token: str
    launched: Launched | None

    def hand_over(self) -> Launched:
        """The started mpiexec, now the controller's to watch and end."""
        launched, self.launched = self.launched, None
        assert launched is not None, "handed over twice"
        return launched

    def abandon(self, remove_directory: bool = True) -> None:
        """The job will not run: end mpiexec and everything it started, close the socket, remove the directory
        (unless the session took it over: it removes it, or keeps it with ``--keep-logs``).

        mpiexec is left alone once handed over: the controller ends it.
        """
        if self.launched is not None:
            self.launched.signal_group(signal.SIGKILL)  # no rank has run: nothing to let finish
            self.launched.reap()
            if self.launched.fd is not None:
                os.close(self.launched.fd)
            self.launched = None
        self.listener.close()
        if remove_directory:
            with contextlib.suppress(OSError):
                self.dirs.remove()


def head_start(config: JobConfig, backend: Backend, program: str) -> HeadStart | None:
    """Start the job's mpiexec now if the job runs through the single-host mpiexec launcher; else None."""
    if not isinstance(backend, MpiexecBackend) or isinstance(backend, HostsBackend):
        return None
    dirs = SessionDirs.create(session_base(None), [])
    try:
        listener = Listener(f"unix:{dirs.control_socket}")
    except BaseException:
        dirs.remove()
        raise
    head = HeadStart(dirs, listener, new_token(), None)
    try:
        (spec,) = backend.specs(config, program, control_env(os.environ, listener, head.token))
        head.launched = Launched(spec)
    except OSError as exc:  # as the controller says it when a launcher cannot start
        head.abandon()
        raise MPSError(f"cannot start rank(s) 0-{config.ranks - 1}: {exc}", command=backend.mpiexec) from None
    except BaseException:
        head.abandon()
        raise
    return head
