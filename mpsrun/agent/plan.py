"""Placement: which GPU and limits each rank gets, the daemons' defaults, and the one rank environment.

Pure functions, no I/O. Every path (local ranks, ranks under mpiexec, per-node ranks) gets its
variables from :func:`rank_environment`, through :func:`welcome`; the launcher and node keepers give
their daemons :func:`daemon_defaults`, from the same rules.
"""

from __future__ import annotations

import functools
import importlib.util
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mpsrun.config.options import JobConfig
from mpsrun.config.values import AUTO, Auto, Queues, check_shares
from mpsrun.errors import ConfigError
from mpsrun.mps.environment import MANAGED_VARIABLES, GpuTarget, worker_variables
from mpsrun.mps.limits import GPU_CONNECTIONS, DaemonDefaults, auto_mem_limits, client_connections
from mpsrun.rank.frameworks import TORCHRUN_DEFAULTS, rank_defaults, shared_gpu_defaults, torchrun_layout
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

__all__ = [
    "NodePlan",
    "RankPlan",
    "callers_values",
    "free_port",
    "gpu_of_rank",
    "mpi4py_abort",
    "mpi4py_available",
    "rank_environment",
    "ranks_on_gpus",
    "ranks_per_gpu",
    "rendezvous",
    "welcome",
    "without_mps",
]


@functools.cache
def mpi4py_available() -> bool:
    """Whether this interpreter has mpi4py (asked once: a search of every path entry)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi4py_abort(setting: str) -> bool:
    """Whether Python ranks run under mpi4py's runner: ``--mpi4py-abort`` is on, and mpi4py is installed."""
    return setting == "on" and mpi4py_available()


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Where one rank runs: its GPU (position in the session's list) and its limits."""

    rank: int
    gpu: int
    thread_percentage: int | None = None
    mem_limit: int | None = None  # MiB
    priority: int | None = None
    sharers: int | None = None  # the node's ranks on its GPU (under --gpu-bind none: spread evenly), when known
    clients: int | None = None  # the node's ranks its MPS server serves (all of them under --gpu-bind none), when known

    @property
    def unlimited_sharing(self) -> bool:
        """It shares its GPU with other ranks and has no memory limit (a failure out of memory then names that)."""
        return self.sharers is not None and self.sharers > 1 and self.mem_limit is None


def gpu_of_rank(local_rank: int, local_size: int | None, ngpus: int, policy: str) -> int:
    """``block``: even runs of consecutive ranks per GPU; ``round-robin``: rank modulo GPUs."""
    if ngpus == 1:
        return 0
    if policy == "round-robin":
        return local_rank % ngpus
    if local_size is None:
        raise ConfigError("--map-by block needs the number of ranks on this node, and the launcher does not say it; "
                          "use --map-by round-robin", setting="--map-by")
    return min(ngpus - 1, local_rank * ngpus // local_size)


def _sharing(config: JobConfig, local_size: int | None, ngpus: int, option: str) -> list[int]:
    """How many of the node's ranks share each GPU position (under --gpu-bind none: spread evenly)."""
    if local_size is None:
        raise ConfigError(f"{option} auto needs the number of ranks on this node, and the launcher does not say it; "
                          "give a value", setting=option)
    if config.gpu_bind == "none":
        return [-(-local_size // ngpus)] * ngpus
    return ranks_per_gpu(local_size, ngpus, config.map_by)


def ranks_per_gpu(local_size: int, ngpus: int, policy: str) -> list[int]:
    """How many of ``local_size`` ranks :func:`gpu_of_rank` puts on each GPU, counted without going through them
    (every rank's plan asks, and a loop made a job's planning quadratic in its ranks)."""
    if policy == "round-robin" or ngpus == 1:
        return [local_size // ngpus + (gpu < local_size % ngpus) for gpu in range(ngpus)]
    # block: GPU g has the ranks r with g <= r * ngpus / local_size < g + 1
    first = [-(-gpu * local_size // ngpus) for gpu in range(ngpus + 1)]
    return [first[gpu + 1] - first[gpu] for gpu in range(ngpus)]


def _mem_limits(config: JobConfig, local_size: int | None, ngpus: int, free: Sequence[int]) -> list[int | None]:
    """The pinned memory limit of each GPU position in MiB (``free``: each GPU's free bytes; empty without MPS)."""
    if config.mem_limit != AUTO:
        assert not isinstance(config.mem_limit, Auto)
        return [config.mem_limit] * max(ngpus, 1)
    if not free:
        return [None] * max(ngpus, 1)
    return auto_mem_limits(free, _sharing(config, local_size, len(free), "--mem-limit"), config.gpu_bind == "none")


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node's placement, worked out once for all its ranks: how many of them share each GPU position, and each
    position's memory limit. Every rank's plan and the daemons' defaults read it, so planning a node is linear in
    its ranks. ``local_size``: the node's ranks, when the launcher says (``auto`` and ``--map-by block`` need it:
    without it each rank's plan is refused); ``free``: each GPU's free bytes under MPS (for ``--mem-limit auto``).
    Make one with :meth:`make`."""

    config: JobConfig
    ngpus: int
    local_size: int | None
    free: tuple[int, ...]
    sharing: tuple[int, ...]  # per GPU position; empty when the node's size is not known
    mem_limits: tuple[int | None, ...]  # per GPU position, MiB
    refused: ConfigError | None  # why no rank of this node can be planned (auto without the node's size)

    @classmethod
    def make(cls, config: JobConfig, ngpus: int, local_size: int | None, free: Sequence[int] = (),
             world_size: int | None = None) -> NodePlan:
        """``world_size``: the job's ranks, when known: a --thread-percentage list must give one value each."""
        check_shares(config.thread_percentage, world_size)
        sharing = () if local_size is None or ngpus < 1 else tuple(_sharing(config, local_size, ngpus, ""))
        try:
            limits, refused = _mem_limits(config, local_size, ngpus, free), None
        except ConfigError as exc:  # what cannot be honoured at all is refused before anything starts; auto without
            if local_size is not None:  # the node's size: the daemons get no default limit, each rank a refusal
                raise
            limits, refused = [None] * max(ngpus, 1), exc
        return cls(config, ngpus, local_size, tuple(free), sharing, tuple(limits), refused)

    def sized(self, local_size: int | None) -> NodePlan:
        """This plan for a node of ``local_size`` ranks (a rank's launcher may say what the node's did not)."""
        return self if local_size == self.local_size else NodePlan.make(self.config, self.ngpus, local_size, self.free)

    def rank(self, identity: RankIdentity) -> RankPlan:
        """One rank's GPU and limits; raises ConfigError for what cannot be honoured. Under ``--gpu-bind none`` every
        rank has GPU position 0: the one daemon, which serves all the GPUs."""
        plan = self.sized(identity.local_world_size)
        if plan.refused is not None:
            raise plan.refused
        config = plan.config
        if plan.ngpus < 1:
            return RankPlan(identity.rank, 0, None, plan.mem_limits[0], config.priority)
        gpu = 0 if config.gpu_bind == "none" else gpu_of_rank(identity.local_rank, plan.local_size, plan.ngpus,
                                                              config.map_by)
        sharers = plan.sharing[gpu] if plan.sharing else None
        clients = plan.local_size if config.gpu_bind == "none" else sharers
        return RankPlan(identity.rank, gpu, plan._percentage(identity, gpu), plan.mem_limits[gpu], config.priority,
                        sharers, clients)

    def ranks(self, count: int) -> list[RankPlan]:
        """Every rank of a one-node job of ``count`` ranks (all local), checked before anything starts."""
        plan = self.sized(count)
        return [plan.rank(RankIdentity(r, r, count, count)) for r in range(count)]

    def _percentage(self, identity: RankIdentity, gpu: int) -> int | None:
        spec = self.config.thread_percentage
        if spec is None or isinstance(spec, int):
            return spec
        if spec == AUTO:
            sharing = self.sharing or _sharing(self.config, None, self.ngpus, "--thread-percentage")  # (raises)
            return _auto_percentage(sharing[gpu])
        assert isinstance(spec, tuple)
        check_shares(spec, identity.world_size if identity.rank < len(spec) else identity.rank + 1)
        return spec[identity.rank]

    def daemon_defaults(self) -> DaemonDefaults:
        """What the node's daemons apply to a client that sets no limit itself: the highest cap any rank has (none
        when some rank has none), and each GPU's memory limit."""
        spec, cap = self.config.thread_percentage, None
        if isinstance(spec, int):
            cap = spec
        elif isinstance(spec, tuple):
            cap = max(spec)
        elif spec == AUTO and self.sharing:
            cap = max(_auto_percentage(n) for n in self.sharing if n)
        return DaemonDefaults(cap, self.mem_limits)


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


def _auto_percentage(sharers: int) -> int:
    """``--thread-percentage auto``: an even share of the SMs among a GPU's ranks."""
    return max(1, 100 // sharers)


def rank_environment(target: GpuTarget | None, plan: RankPlan | None, identity: RankIdentity | None = None,
                     local_rank: int | None = None) -> dict[str, str]:
    """The variables mpsrun gives one rank: its GPUs and MPS variables (``target``, None: no GPU known) with the
    limits of its ``plan``, and its place in the job (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE`` where known, and torchrun's layout variables). ``local_rank``: what LOCAL_RANK says, if not
    the rank's place on its node."""
    env: dict[str, str] = {}
    if target is not None:
        limits = (plan.thread_percentage, plan.mem_limit, plan.priority) if plan is not None else ()
        env.update(worker_variables(target, *limits))
    if identity is not None:
        if plan is not None and target is not None:
            env["MPSRUN_GPU"] = str(plan.gpu)
        local = identity.local_rank if local_rank is None else local_rank
        env.update(RANK=str(identity.rank), LOCAL_RANK=str(local), MPSRUN_RANK=str(identity.rank))
        if identity.world_size is not None:
            env["WORLD_SIZE"] = str(identity.world_size)
        if identity.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(identity.local_world_size)
        env.update(torchrun_layout(identity.rank, identity.world_size, identity.local_world_size))
    return env


def ranks_on_gpus(plans: Sequence[RankPlan]) -> dict[int, int]:
    """GPU position -> number of ranks placed on it."""
    counts: dict[int, int] = {}
    for plan in plans:
        counts[plan.gpu] = counts.get(plan.gpu, 0) + 1
    return counts


def without_mps(config: JobConfig, reason: str, gpus_seen: bool = True) -> list[str]:
    """What to say once when the ranks run without MPS: why (unless ``--mps off`` asked for it), and which options
    then have no effect (``gpus_seen``: whether the GPUs could be listed; without a driver, ``--gpus`` has none
    either)."""
    unused = [flag for flag, value in (("--gpus", None if gpus_seen else config.gpus),
                                       ("--thread-percentage", config.thread_percentage),
                                       ("--mem-limit", config.mem_limit), ("--priority", config.priority),
                                       ("--queues", config.queues))
              if value is not None]
    lines = [] if config.mps == "off" else [f"running without MPS: {reason}"]  # asked for: nothing to say
    if unused:
        lines.append(f"warning: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without MPS"
                     + ("" if gpus_seen else " and a GPU"))
    return lines


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
    queues = _rank_queues(config.queues, clients, "CUDA_MPS_PIPE_DIRECTORY" in env)
    if queues is not None:  # asked for on the command line: it wins over the caller's variable
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(queues)
    gpu_clients = clients if config.gpu_bind == "single" or ngpus == 1 else None
    sent = Welcome(env=env, defaults=defaults, managed=list(MANAGED_VARIABLES), restore=restore, tag=config.tag_output,
                   grace=config.grace, timeout=config.timeout, mpi4py_abort=mpi4py_abort, output_lock=output_lock,
                   output_dir=config.output_filename, gpu_clients=gpu_clients,
                   gpu_queues=None if gpu_clients is None else GPU_CONNECTIONS, lines=list(lines))
    return sent, plan if ngpus else None


def _rank_queues(queues: Queues, clients: int | None, mps_client: bool) -> int | None:
    """An MPS rank's hardware work queues: ``--queues`` N, or under ``auto`` as many as a plain process has while
    its GPU's budget lasts among its server's ``clients`` (None where they are not known: MPS's default). None for
    a rank that is no MPS client."""
    if not mps_client:
        return None
    if queues == AUTO:
        return None if clients is None else client_connections(clients)
    return None if queues is None else int(queues)


def _device_number(identity: RankIdentity, config: JobConfig, ngpus: int) -> int | None:
    """LOCAL_RANK under ``--local-rank device``: a device the rank can use (its one GPU is device 0; seeing every
    GPU, the rank's place on the node modulo the GPUs); None: LOCAL_RANK is the rank's place on its node."""
    if config.local_rank != "device":
        return None
    return 0 if config.gpu_bind == "single" or ngpus < 1 else identity.local_rank % ngpus
