"""A rank's welcome: the one environment every rank of every path gets from its node's agent, and how its
supervisor runs it, from the node's plan (:mod:`mpsrun.mps.placement`).

Pure functions but for :func:`free_port` and :func:`mpi4py_available`.
"""

from __future__ import annotations

import functools
import importlib.util
import socket
from collections.abc import Callable, Mapping, Sequence

from mpsrun.config.options import JobConfig
from mpsrun.mps.environment import MANAGED_VARIABLES, GpuTarget
from mpsrun.mps.limits import GPU_CONNECTIONS
from mpsrun.mps.placement import NodePlan, RankPlan, rank_environment, rank_queues
from mpsrun.rank.frameworks import TORCHRUN_DEFAULTS, rank_defaults, shared_gpu_defaults
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import (
    CONTROL_VARIABLES,
    JOB_ID_VARIABLE,
    LAUNCHER_PREFIXES,
    LAUNCHER_REWRITES,
    RENDEZVOUS_VARIABLES,
    SESSION_DIR_VARIABLE,
)
from mpsrun.runtime.protocol import Welcome

__all__ = ["callers_values", "free_port", "mpi4py_abort", "mpi4py_available", "rendezvous", "welcome"]


@functools.cache
def mpi4py_available() -> bool:
    """Whether this interpreter has mpi4py (asked once: a search of every path entry)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi4py_abort(setting: str) -> bool:
    """Whether Python ranks run under mpi4py's runner: ``--mpi4py-abort`` is on, and mpi4py is installed."""
    return setting == "on" and mpi4py_available()


def free_port() -> int:
    """A TCP port free on this host now (the kernel's choice), for a rendezvous of the job's ranks."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def rendezvous(host: str, port: int, environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's ``env://`` rendezvous, as torchrun gives it: ``MASTER_ADDR``, rank 0's ``host``, and
    ``MASTER_PORT``, one ``port`` for the whole job. What the caller set (``environ``) is left alone."""
    found = dict(zip(RENDEZVOUS_VARIABLES, (host.split(":", 1)[0], str(port)), strict=True))
    return {name: value for name, value in found.items() if name not in environ}


def callers_values(caller: Mapping[str, str]) -> dict[str, str | None]:
    """What a rank takes from the caller's environment whatever its launcher did: every variable but those mpsrun
    manages and the launchers' own, and PATH and LD_LIBRARY_PATH unset where the caller has none."""
    own = {*MANAGED_VARIABLES, *CONTROL_VARIABLES, JOB_ID_VARIABLE}
    values: dict[str, str | None] = {name: None for name in LAUNCHER_REWRITES}
    values.update((name, value) for name, value in caller.items()
                  if name not in own and not name.startswith(LAUNCHER_PREFIXES))
    return values


def welcome(identity: RankIdentity, node: NodePlan, target_of: Callable[[int], GpuTarget | None], mpi4py_abort: bool, *,
            session_dir: str | None = None, output_lock: str | None = None,
            callers: Mapping[str, str | None] | None = None, extra: Mapping[str, str] | None = None,
            lines: Sequence[str] = ()) -> tuple[Welcome, RankPlan | None]:
    """What a rank's supervisor is told when it says hello (the rank's variables and how to run it), and the rank's
    plan (None where the node has no GPU).

    ``node``: the plan of the rank's node. ``session_dir``: the job's (or node's) private directory, also without
    MPS (:mod:`mpsrun.shared` keeps its handles there). ``mpi4py_abort``: whether Python ranks run through mpi4py's
    runner (mpi4py is installed, and not off). ``callers``: :func:`callers_values` of the environment the job was
    started from, when this process has it (the ``mpsrun`` command, not a node keeper): what an MPI launcher rewrote
    of it is put back. ``extra``: variables of the node's own (a one-node per-node job's rendezvous); ``lines``: what
    the rank says once.
    """
    config, ngpus = node.config, node.ngpus
    plan = node.rank(identity)
    target = target_of(plan.gpu) if ngpus else None
    env = {**rank_environment(target, plan, identity, _device_number(identity, config, ngpus)), **(extra or {})}
    if session_dir is not None:
        env.setdefault(SESSION_DIR_VARIABLE, session_dir)
    restore: dict[str, str | None] = dict(callers or {})
    for item in config.exports:  # -x: resolved where the command line was read
        name, given, value = item.partition("=")
        restore[name] = value if given else None
    defaults = [{name: value} for name, value in TORCHRUN_DEFAULTS.items()]  # each alone: one the caller set wins
    defaults += shared_gpu_defaults(env, plan.sharers, target.multiprocessors if target else None)
    defaults += rank_defaults(env, identity.rank)
    clients = plan.clients if "CUDA_MPS_PIPE_DIRECTORY" in env else None  # an MPS client's server's, when known
    queues = rank_queues(config.queues, clients, "CUDA_MPS_PIPE_DIRECTORY" in env)
    if queues is not None:  # asked for on the command line: it wins over the caller's variable
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(queues)
    gpu_clients = clients if config.gpu_bind == "single" or ngpus == 1 else None
    sent = Welcome(env=env, defaults=defaults, managed=list(MANAGED_VARIABLES), restore=restore, tag=config.tag_output,
                   grace=config.grace, timeout=config.timeout, mpi4py_abort=mpi4py_abort, output_lock=output_lock,
                   output_dir=config.output_filename, gpu_clients=gpu_clients,
                   gpu_queues=None if gpu_clients is None else GPU_CONNECTIONS, lines=list(lines))
    return sent, plan if ngpus else None


def _device_number(identity: RankIdentity, config: JobConfig, ngpus: int) -> int | None:
    """LOCAL_RANK under ``--local-rank device``: a device the rank can use (its one GPU is device 0; seeing every
    GPU, the rank's place on the node modulo the GPUs); None: LOCAL_RANK is the rank's place on its node."""
    if config.local_rank != "device":
        return None
    return 0 if config.gpu_bind == "single" or ngpus < 1 else identity.local_rank % ngpus
