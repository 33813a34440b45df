"""What a backend starts, watched: a rank's supervisor (forked by the local launcher) or an MPI launcher.

Each started process runs in a session of its own, is watched through a pidfd, and gets SIGTERM
if the process that started it dies.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import unread_output
from mpsrun.runtime.processes import ProcessRef, descendants, pidfd, set_parent_death_signal

if TYPE_CHECKING:
    from mpsrun.rank.forked import ForkedSupervisor

__all__ = ["LaunchSpec", "Launched", "Launchers"]

#: How often a launcher's wind-down looks whether our output has been read.
OUTPUT_LOOK = 0.1


class LaunchSpec(NamedTuple):
    """A process to start, and the ranks it is responsible for."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    ranks: tuple[int, ...]
    stdin: bool = False
    #: ``argv`` are a rank supervisor's arguments: it is forked from this process (no interpreter to start).
    fork: bool = False
    #: The launcher exits with this plus S when a process it started was killed by signal S (128: Open MPI); None
    #: when that cannot be told from its other codes.
    signal_status: int | None = None
    #: The hosts it starts the job's node keepers on (``--hosts``), as given: a failure names those never heard from.
    hosts: tuple[str, ...] = ()


class Launched:
    """A started process, in its own session, watched through a pidfd; it gets SIGTERM if we die."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.popen: subprocess.Popen[bytes] | ForkedSupervisor
        if spec.fork:
            from mpsrun.rank.forked import ForkedSupervisor  # the local launcher's only

            self.popen = ForkedSupervisor(spec.argv, spec.env, spec.stdin)
        else:
            self.popen = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), stdin=None if spec.stdin else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=functools.partial(set_parent_death_signal, signal.SIGTERM, os.getpid()))
        self.fd = pidfd(self.popen.pid)

    @property
    def ended(self) -> bool:
        return self.popen.returncode is not None

    def reap(self) -> int:
        return self.popen.wait()

    def signal_group(self, sig: int) -> None:
        if self.popen.poll() is None:  # not reaped: its pid still names its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)


class Launchers:
    """What a backend started, each watched through its pidfd; ``on_exit`` is called once it has been reaped."""

    PER_TURN = 8  # each start takes a millisecond or two

    def __init__(self, loop: EventLoop, on_exit: Callable[[Launched, int], None],
                 on_error: Callable[[LaunchSpec, OSError], None]) -> None:
        self.loop, self.on_exit, self.on_error = loop, on_exit, on_error
        self.started: list[Launched] = []
        self.pending: list[LaunchSpec] = []
        self._winding_down = False
        self._descendants: set[ProcessRef] = set()  # of the MPI launchers, as seen when they were signalled

    def launch(self, specs: Sequence[LaunchSpec]) -> None:
        """Start ``specs``, a few per turn of the loop, so a signal or a failure is handled while hundreds start;
        one that cannot be started goes to ``on_error``."""
        self.pending = list(specs)
        self._next()

    def _next(self) -> None:
        for _ in range(min(self.PER_TURN, len(self.pending))):
            spec = self.pending.pop(0)
            try:
                self.start(spec)
            except OSError as exc:
                self.on_error(spec, exc)
                break  # the job is failing: on_error cancels the rest
        if self.pending:
            self.loop.after(0, self._next)

    def start(self, spec: LaunchSpec) -> Launched:
        """Start one now (raises OSError), watched from the loop's next turn (the mpiexec launcher's head start)."""
        started = Launched(spec)
        self.started.append(started)
        if started.fd is not None:
            self.loop.watch(started.fd, functools.partial(self._exited, started))
        else:  # no pidfds on this kernel: a bounded poll interval
            self._poll(started)
        return started

    def cancel(self) -> list[int]:
        """Start nothing more (the job is stopping); the ranks that will now never start."""
        ranks = [rank for spec in self.pending for rank in spec.ranks]
        self.pending = []
        return ranks

    @property
    def ended(self) -> bool:
        return not self.pending and all(started.ended for started in self.started)

    def _poll(self, started: Launched) -> None:
        if started.popen.poll() is None:
            self.loop.after(0.05, lambda: self._poll(started))
        else:
            self._exited(started)

    def _exited(self, started: Launched) -> None:
        if started.fd is not None:
            self.loop.unwatch(started.fd)
            os.close(started.fd)
            started.fd = None
        self.on_exit(started, started.reap())

    def kill_leftovers(self) -> None:
        """At the job's end: SIGKILL what the MPI launchers had started when they were told to stop and is still
        there (Hydra puts each ssh to a host in a session of its own, and one to a host cut off outlives mpiexec,
        saying goodbye over the dead link). Each is the very process seen (pid and start time)."""
        for process in self._descendants:
            process.signal(signal.SIGKILL)

    def wind_down(self, grace: float) -> None:
        """Every rank has ended (or was killed): the launchers get ``grace`` to exit, then SIGTERM, then ``grace``
        more, then SIGKILL. Until the SIGTERM the time counts only while our output holds nothing unread: an MPI
        launcher still passing the ranks' output on to a slow reader (``| less``) is not hung, and stopping it lost
        that output."""
        if self._winding_down or self.ended:
            return
        self._winding_down = True
        grace = max(grace, 0.5)
        self._when_output_read(grace, time.monotonic())

    def _when_output_read(self, grace: float, quiet_since: float) -> None:
        if self.ended:
            return
        now = time.monotonic()
        if unread_output():
            quiet_since = now
        if now - quiet_since < grace:
            self.loop.after(min(grace, OUTPUT_LOOK), lambda: self._when_output_read(grace, quiet_since))
            return
        self._signal(signal.SIGTERM)
        self.loop.after(grace, lambda: self._signal(signal.SIGKILL))

    def kill(self) -> None:
        """SIGKILL every launcher now (a second Ctrl-C), and start nothing more."""
        self.pending = []
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        for started in self.started:
            if not started.spec.fork and not started.ended:
                self._descendants.update(descendants(started.popen.pid))
            started.signal_group(sig)
