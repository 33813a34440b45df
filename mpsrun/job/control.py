"""Where a job's rank supervisors reach its controller, and the MPI launcher started ahead of the session.

mpiexec takes about 0.3 s to start its ranks (Open MPI on the H100 machine), so the mpiexec launcher
starts it as soon as the control socket exists (:attr:`mpsrun.job.backends.Backend.head_start`): the GPUs
are read and the MPS daemons started meanwhile, and the rank supervisors wait in the socket's backlog
for their welcome, which the controller gives once the daemons answer.
"""

from __future__ import annotations

import os
import signal

from mpsrun.errors import MPSError
from mpsrun.job.backends import Launched, LaunchSpec
from mpsrun.runtime.interrupts import uninterrupted

__all__ = ["JobControl"]


class JobControl:
    """Where the job's rank supervisors reach its controller: ``listener``, ``token`` and the variables that name
    them (``env``); and the MPI launcher when it starts ahead of the session (``early``), until the controller
    adopts it."""

    def __init__(self, where: str) -> None:
        from mpsrun.runtime.protocol import Listener, new_token

        self.token = new_token()
        self.listener = Listener(where)
        self.env = {**os.environ, "MPSRUN_CONTROL": self.listener.address, "MPSRUN_CONTROL_TOKEN": self.token,
                    "MPSRUN_JOB_ID": self.token[:16]}
        self.early: Launched | None = None

    def start_early(self, specs: list[LaunchSpec]) -> None:
        """Start the launcher now; its ranks wait for their welcome until the controller runs."""
        (spec,) = specs
        try:
            with uninterrupted():  # a Popen cut short would lose the process
                self.early = Launched(spec)
        except OSError as exc:  # as the controller says it when a launcher cannot start
            from mpsrun.job.outcome import ranges

            raise MPSError(f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}", command=spec.argv[0]) from None

    def hand_over(self) -> Launched | None:
        early, self.early = self.early, None
        return early

    def close(self) -> None:
        """Close the socket; a launcher never handed over (the job failed before its controller ran) is killed:
        no rank of it has run."""
        if self.early is not None:
            self.early.signal_group(signal.SIGKILL)
            self.early.reap()
            if self.early.fd is not None:
                os.close(self.early.fd)
            self.early = None
        self.listener.close()
