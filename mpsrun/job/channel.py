"""Where a job's rank supervisors reach its controller, and the MPI launcher started ahead of the session.

mpiexec takes about 0.3 s to start its ranks (Open MPI on the H100 machine), so the mpiexec launcher
starts it as soon as the control socket exists (:attr:`mpsrun.job.backends.Backend.head_start`): the GPUs
are read and the MPS daemons started meanwhile, and the rank supervisors wait in the socket's backlog
for their welcome, which the controller gives once the daemons answer.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping, Sequence

from mpsrun.errors import MPSError
from mpsrun.job.launch import Launched, LaunchSpec
from mpsrun.job.outcome import ranges
from mpsrun.runtime.constants import CONTROL_VARIABLE, JOB_ID_VARIABLE, RENDEZVOUS_VARIABLES, TOKEN_VARIABLE
from mpsrun.runtime.interrupts import uninterrupted
from mpsrun.runtime.protocol import Listener, new_token

__all__ = ["ControlChannel", "free_port", "listen_address", "rendezvous"]


def free_port() -> int:
    """A TCP port free on this host now (the kernel's choice), for a rendezvous of the job's ranks."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def listen_address(hosts: Sequence[str]) -> str:
    """Where the controller of a job over ``hosts`` (names or addresses) listens: this host's address on the way to
    them, as the kernel would send from it; one other than loopback where some are reached over loopback and the
    rest one other way. Every interface ("") only where they are reached over several, or none resolves (the
    launcher then says why)."""
    found: set[str] = set()
    for host in hosts:
        try:
            target = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # a UDP connect sends nothing: it picks the route and the source address
                found.add(str(probe.getsockname()[0]))
        except OSError:
            continue
    beyond = {address for address in found if not address.startswith("127.")}
    return next(iter(found)) if len(found) == 1 else next(iter(beyond)) if len(beyond) == 1 else ""


def rendezvous(host: str, port: int, environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's ``env://`` rendezvous, as torchrun gives it: ``MASTER_ADDR``, rank 0's ``host``, and
    ``MASTER_PORT``, one ``port`` for the whole job. What the caller set (``environ``) is left alone."""
    found = dict(zip(RENDEZVOUS_VARIABLES, (host.split(":", 1)[0], str(port)), strict=True))
    return {name: value for name, value in found.items() if name not in environ}


class ControlChannel:
    """Where the job's rank supervisors reach its controller: ``listener``, ``token`` and the environment that names
    them (``env``: the caller's, plus ``extra`` and those variables); and the MPI launcher when it starts ahead of
    the session (``early``), until the controller takes it."""

    def __init__(self, where: str, extra: Mapping[str, str] | None = None) -> None:
        self.token = new_token()
        self.listener = Listener(where)
        self.env = {**os.environ, **(extra or {}), CONTROL_VARIABLE: self.listener.address, TOKEN_VARIABLE: self.token,
                    JOB_ID_VARIABLE: self.token[:16]}
        self.early: Launched | None = None

    def start_early(self, specs: list[LaunchSpec]) -> None:
        """Start the launcher now; its ranks wait for their welcome until the controller runs."""
        (spec,) = specs
        try:
            with uninterrupted():  # a Popen cut short would lose the process
                self.early = Launched(spec)
        except OSError as exc:  # as the controller says it when a launcher cannot start
            raise MPSError(f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}") from None

    def hand_over(self) -> Launched | None:
        """The launcher started early, for the controller to watch from now on (this channel no longer ends it)."""
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
