"""Backends: how a job's rank supervisors get started. Everything after that is the controller's.

Every rank runs under a rank supervisor (:mod:`mpsrun.rank.supervisor`) that reports to the job's
controller, so the backends differ only in what they start:

* ``local``: one supervisor per rank, forked by mpsrun itself (:mod:`mpsrun.rank.forked`);
* ``mpiexec``: one ``mpiexec`` that starts the supervisors (mpi4py sees the whole world);
* ``hosts``: one ``mpiexec`` over several hosts, every rank through ``mpsrun --per-node``,
  so each host's node keeper owns that host's MPS daemons and relays to the controller.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpsrun.config.options import JobConfig, option_variables, to_argv
from mpsrun.errors import ConfigError
from mpsrun.job import mpiexec as mpi
from mpsrun.runtime.processes import physical_cores, pidfd, python_without_site, set_parent_death_signal

if TYPE_CHECKING:
    from mpsrun.rank.forked import ForkedSupervisor
    from mpsrun.runtime.loop import EventLoop

__all__ = [
    "Backend",
    "HostsBackend",
    "LaunchSpec",
    "Launched",
    "Launchers",
    "LocalBackend",
    "MpiexecBackend",
    "choose_backend",
]

#: The rank supervisor, started by an MPI launcher (the local launcher forks it: :mod:`mpsrun.rank.forked`).
SHIM = tuple(python_without_site("mpsrun.rank.supervisor"))


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """A process to start, and the ranks it is responsible for."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    ranks: tuple[int, ...]
    stdin: bool = False
    #: ``argv`` are a rank supervisor's arguments: it is forked from this process (no interpreter to start).
    fork: bool = False


class Launched:
    """A started process, in its own session, watched through a pidfd; it gets SIGTERM if we die."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.popen: subprocess.Popen[bytes] | ForkedSupervisor
        if spec.fork:
            from mpsrun.rank.forked import ForkedSupervisor  # only for local ranks (3 ms): see job._import_the_launch

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

    def launch(self, specs: Sequence[LaunchSpec]) -> None:
        """Start ``specs``, a few per turn of the loop, so a signal or a failure is handled while hundreds start;
        one that cannot be started goes to ``on_error``."""
        self.pending = list(specs)
        self._next()

    def _next(self) -> None:
        for _ in range(min(self.PER_TURN, len(self.pending))):
            spec = self.pending.pop(0)
            try:
                self._start(spec)
            except OSError as exc:
                self.on_error(spec, exc)
                break  # the job is failing: on_error cancels the rest
        if self.pending:
            self.loop.after(0, self._next)

    def _start(self, spec: LaunchSpec) -> None:
        self.adopt(Launched(spec))

    def adopt(self, started: Launched) -> None:
        """Watch a process started before the loop ran (the mpiexec launcher's head start)."""
        self.started.append(started)
        if started.fd is not None:
            self.loop.watch(started.fd, functools.partial(self._exited, started))
        else:  # no pidfds on this kernel: a bounded poll interval
            self._poll(started)

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

    def wind_down(self, grace: float) -> None:
        """Every rank has ended (or was killed): the launchers get ``grace`` to exit, then SIGTERM, then SIGKILL."""
        if self._winding_down or self.ended:
            return
        self._winding_down = True
        grace = max(grace, 0.5)
        self.loop.after(grace, lambda: self._signal(signal.SIGTERM))
        self.loop.after(2 * grace, lambda: self._signal(signal.SIGKILL))

    def kill(self) -> None:
        """SIGKILL every launcher now (a second Ctrl-C), and start nothing more."""
        self.pending = []
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        for started in self.started:
            started.signal_group(sig)


class Backend(Protocol):
    name: str
    #: ``unix``: the ranks reach the controller's socket in the session directory; ``tcp``: over the network.
    control: str
    #: False when each host's node keeper starts that host's MPS daemons instead of the controller.
    owns_daemons: bool
    #: When each MPS server is asked for, in seconds after the first rank starts, unless every rank has ended by
    #: then; None: with its first client, as a hand-started daemon does. A server takes 0.17-0.26 s to become ready
    #: (H100) and its first client waits for it: ranks that use the GPU from Python take longer than 0.25 s to reach
    #: CUDA (importing CuPy, PyTorch or JAX), so they do not wait, and a job over by then never pays for a server
    #: it did not use (its quit alone takes 0.1 s).
    server_after: float | None
    #: The launcher starts before the MPS session (``Job``), its ranks waiting for their welcome: an MPI launcher
    #: takes 0.3 s to start its ranks, in which the session comes up.
    head_start: bool

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]: ...


#: When the mpiexec and the local launcher ask for each MPS server: see Backend.server_after.
SERVER_AFTER = 0.25


class LocalBackend:
    name, control, owns_daemons, head_start = "local", "unix", True, False
    server_after: float | None = SERVER_AFTER

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        n = config.ranks
        return [
            LaunchSpec(f"rank {r}'s supervisor", ("--rank", str(r), "--local-rank", str(r), "--size", str(n),
                                                  "--local-size", str(n), "--", program, *config.command[1:]),
                       env, (r,), stdin=r == 0, fork=True)
            for r in range(n)
        ]


class MpiexecBackend:
    name, control, owns_daemons, head_start = "mpiexec", "unix", True, True
    server_after: float | None = SERVER_AFTER

    def __init__(self, mpiexec: str) -> None:
        self.mpiexec = mpiexec

    @functools.cached_property
    def flavour(self) -> str:
        return mpi.detect_flavour(self.mpiexec)  # asked as the command line is built

    def _argv(self, config: JobConfig, rank_command: Sequence[str], extra: Sequence[str] = (),
              export: Sequence[str] = (), cores: int | None = None) -> tuple[str, ...]:
        return tuple(mpi.mpiexec_command(self.mpiexec, self.flavour, config.ranks, rank_command,
                                         [*extra, *config.mpiexec_args], cores=cores, export=export))

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        # The program by absolute path: Open MPI puts its own bin directory first on the ranks' PATH.
        argv = self._argv(config, [*SHIM, "--", program, *config.command[1:]], cores=physical_cores())
        return [LaunchSpec("mpiexec", argv, env, tuple(range(config.ranks)), stdin=True)]


class HostsBackend(MpiexecBackend):
    name, control, owns_daemons, head_start = "hosts", "tcp", False, False
    server_after: float | None = None
    EXPORT = ("MPSRUN_CONTROL", "MPSRUN_CONTROL_TOKEN", "MPSRUN_JOB_ID")

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        hosts = mpi.host_arguments(self.flavour, config.hosts, config.hostfile)
        # The options are forwarded on the command line (defaults left out): a rank must not read them again
        # from MPSRUN_* variables, or a variable would beat a command-line value equal to the default.
        env = {name: value for name, value in env.items() if name not in option_variables()}
        per_node = [sys.executable, "-m", "mpsrun", "--per-node", *to_argv(config), "--", program, *config.command[1:]]
        # Open MPI gives each --host one slot: the ranks are spread over them (--oversubscribe).
        argv = self._argv(config, per_node, hosts, export=self.EXPORT, cores=None if config.hosts else 1 << 20)
        return [LaunchSpec("mpiexec", argv, env, tuple(range(config.ranks)), stdin=True)]


def choose_backend(config: JobConfig) -> Backend:
    """``--hosts``/``--hostfile`` go through mpiexec over the hosts; ``auto`` takes mpiexec when it and mpi4py exist."""
    if config.hosts or config.hostfile:
        if config.launcher == "local":
            raise ConfigError("--hosts/--hostfile need the mpiexec launcher", setting="--launcher")
        found = mpi.find_mpiexec(config.mpiexec)
        if found is None:
            raise ConfigError("--hosts/--hostfile: no mpiexec or mpirun on PATH", setting="--hosts")
        return HostsBackend(found)
    if config.launcher == "local":
        return LocalBackend()
    found = mpi.find_mpiexec(config.mpiexec)
    if config.launcher == "mpiexec":
        if found is None:
            raise ConfigError("--launcher mpiexec: no mpiexec or mpirun on PATH", setting="--launcher")
        return MpiexecBackend(found)
    if found is not None and (config.mpiexec or mpi.mpi4py_available()):
        return MpiexecBackend(found)
    return LocalBackend()
