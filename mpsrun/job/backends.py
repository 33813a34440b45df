"""Backends: how a job's rank supervisors get started. Everything after that is the controller's.

Every rank runs under a rank supervisor (:mod:`mpsrun.rank.supervisor`) that reports to the job's
controller, so the backends differ only in what they start:

* ``local``: one supervisor per rank, forked by mpsrun itself (:mod:`mpsrun.rank.forked`);
* ``mpiexec``: one ``mpiexec`` that starts the supervisors (mpi4py sees the whole world);
* ``hosts``: one ``mpiexec`` over several hosts, every rank through ``mpsrun --per-node``,
  so each host's node keeper owns that host's MPS daemons and relays to the controller.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol

from mpsrun.agent.welcome import mpi4py_available
from mpsrun.config import values
from mpsrun.config.options import JobConfig, option_variables
from mpsrun.errors import ConfigError
from mpsrun.job import mpiexec as mpi
from mpsrun.job.launch import LaunchSpec
from mpsrun.runtime.constants import (
    CONFIG_VARIABLE,
    CONTROL_VARIABLES,
    JOB_ID_VARIABLE,
    RENDEZVOUS_VARIABLES,
    SERVER_AFTER,
    WORLD_VARIABLE,
)
from mpsrun.runtime.processes import python_without_site

__all__ = ["Backend", "HostsBackend", "LocalBackend", "MpiexecBackend", "choose_backend"]

#: The rank supervisor, started by an MPI launcher (the local launcher forks it: :mod:`mpsrun.rank.forked`).
SHIM = tuple(python_without_site("mpsrun.rank.cli"))


class Backend(Protocol):
    name: str
    #: False when each host's node keeper starts that host's MPS daemons instead of the controller (its ranks then
    #: reach the job's controller over TCP; else at its socket in the session directory).
    owns_daemons: bool
    #: When each MPS server is asked for, in seconds after the last of the job's ranks has started, unless every
    #: rank has ended by then; None: with its first client, as a hand-started daemon does. A server takes a while to
    #: become ready and its first client waits for it: ranks that use the GPU from Python take longer than that to
    #: reach CUDA (importing CuPy, PyTorch or JAX), so they do not wait, and a job over by then never pays for a
    #: server it did not use, however long its many ranks took to start (the figures are in docs/benchmarks.md).
    server_after: float | None
    #: The launcher starts before the MPS session (``Job``), its ranks waiting for their welcome: the session comes
    #: up while an MPI launcher starts its ranks.
    head_start: bool

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]: ...


class LocalBackend:
    name, owns_daemons, head_start = "local", True, False
    server_after: float | None = SERVER_AFTER

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        n = config.ranks
        env = {**env, WORLD_VARIABLE: "local" if config.launcher == "local" else "no-mpiexec"}  # why: for pyrun
        return [
            LaunchSpec(f"rank {r}'s supervisor", ("--rank", str(r), "--local-rank", str(r), "--size", str(n),
                                                  "--local-size", str(n), "--", program, *config.command[1:]),
                       env, (r,), stdin=r == 0, fork=True)
            for r in range(n)
        ]


#: How an MPI flavour's launcher reports a process killed by signal S: exit status offset + S. Open MPI's 128 + S
#: is unambiguous; Hydra (MPICH, Intel) exits with S, as it exits with MPI_Abort's code: which one it was is not
#: known, so its status is taken as it is.
SIGNAL_STATUS = {"openmpi": 128}


class MpiexecBackend:
    name, owns_daemons, head_start = "mpiexec", True, True
    server_after: float | None = SERVER_AFTER

    def __init__(self, mpiexec: str) -> None:
        self.mpiexec = mpiexec

    @functools.cached_property
    def flavour(self) -> str:
        return mpi.detect_flavour(self.mpiexec)  # asked as the command line is built

    def _argv(self, config: JobConfig, rank_command: Sequence[str], extra: Sequence[str] = (),
              export: Sequence[str] = (), oversubscribe: bool = True) -> tuple[str, ...]:
        return tuple(mpi.mpiexec_command(self.mpiexec, self.flavour, config.ranks, rank_command,
                                         [*extra, *config.mpiexec_args], oversubscribe=oversubscribe,
                                         export=export))

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        # The program by absolute path: Open MPI puts its own bin directory first on the ranks' PATH.
        argv = self._argv(config, [*SHIM, "--", program, *config.command[1:]])
        return [self._spec(argv, env, config.ranks)]

    def _spec(self, argv: tuple[str, ...], env: Mapping[str, str], ranks: int, hosts: Sequence[str] = ()
              ) -> LaunchSpec:
        return LaunchSpec("mpiexec", argv, env, tuple(range(ranks)), stdin=True,
                          signal_status=SIGNAL_STATUS.get(self.flavour), hosts=tuple(hosts))


class HostsBackend(MpiexecBackend):
    """Every rank runs as ``mpsrun --per-node`` on its host, handed the job's configuration as data (the
    variable ``CONFIG_VARIABLE``, which Open MPI passes with ``-x``): nothing is parsed or validated again there."""

    name, owns_daemons, head_start = "hosts", False, True
    server_after: float | None = None
    EXPORT = (*CONTROL_VARIABLES, JOB_ID_VARIABLE, *RENDEZVOUS_VARIABLES)  # Open MPI passes no other to a host

    def __init__(self, mpiexec: str) -> None:
        super().__init__(mpiexec)
        mpi.host_arguments(self.flavour, ("localhost",))  # refused now, before anything starts, if unknown

    def specs(self, config: JobConfig, program: str, env: Mapping[str, str]) -> list[LaunchSpec]:
        hosts = mpi.host_arguments(self.flavour, config.hosts, config.hostfile)
        env = {name: value for name, value in env.items() if name not in option_variables()}
        env[CONFIG_VARIABLE] = json.dumps(config.to_json())
        per_node = [sys.executable, "-m", "mpsrun", "--per-node", "--", program, *config.command[1:]]
        # Open MPI gives each --host one slot: the ranks are spread over them (--oversubscribe).
        argv = self._argv(config, per_node, hosts, export=self.EXPORT, oversubscribe=bool(config.hosts))
        return [self._spec(argv, env, config.ranks, values.host_names(config.hosts, config.hostfile))]


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
    if found is not None and (config.mpiexec or mpi4py_available()):
        return MpiexecBackend(found)
    return LocalBackend()
