"""Placement: which GPU and limits each rank gets, and the daemons' defaults: one plan of a node's ranks.

Pure functions, no I/O. A node's plan is worked out once (:class:`NodePlan`) and read by everything that places
ranks: the agent's welcome (:func:`mpsrun.agent.welcome.welcome`), ``--dry-run``, ``-v``, and ``mps_session()``'s
workers (:class:`mpsrun.session.session.Session`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mpsrun.config.options import JobConfig
from mpsrun.config.values import AUTO, Auto, Queues, check_shares
from mpsrun.errors import ConfigError
from mpsrun.mps.environment import GpuTarget, worker_variables
from mpsrun.mps.limits import DaemonDefaults, auto_mem_limits, client_connections
from mpsrun.rank.frameworks import torchrun_layout
from mpsrun.rank.identity import RankIdentity

__all__ = ["NodePlan", "RankPlan", "gpu_of_rank", "rank_environment", "rank_queues", "ranks_on_gpus", "ranks_per_gpu",
           "slot_environment", "without_mps"]


class RankPlan(NamedTuple):
    """Where one rank runs: its GPU (position in the session's list) and its limits."""

    rank: int
    gpu: int
    thread_percentage: int | None = None
    mem_limit: int | None = None  # MiB
    priority: int | None = None
    sharers: int | None = None  # the node's ranks on its GPU (under --gpu-bind none: spread evenly), when known
    clients: int | None = None  # the node's ranks its MPS server serves (all of them under --gpu-bind none), when known
    mem_auto: bool = False  # its memory limit is its share of its GPU's free memory (--mem-limit auto)

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


class NodePlan(NamedTuple):
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
        auto = config.mem_limit == AUTO
        if plan.ngpus < 1:
            return RankPlan(identity.rank, 0, None, plan.mem_limits[0], config.priority, mem_auto=auto)
        gpu = 0 if config.gpu_bind == "none" else gpu_of_rank(identity.local_rank, plan.local_size, plan.ngpus,
                                                              config.map_by)
        sharers = plan.sharing[gpu] if plan.sharing else None
        clients = plan.local_size if config.gpu_bind == "none" else sharers
        return RankPlan(identity.rank, gpu, plan._percentage(identity, gpu), plan.mem_limits[gpu], config.priority,
                        sharers, clients, auto)

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


def rank_queues(queues: Queues, clients: int | None, mps_client: bool) -> int | None:
    """An MPS rank's hardware work queues: ``--queues`` N, or under ``auto`` as many as a plain process has while
    its GPU's budget lasts among its server's ``clients`` (None where they are not known: MPS's default). None for
    a rank that is no MPS client."""
    if not mps_client:
        return None
    if queues == AUTO:
        return None if clients is None else client_connections(clients)
    return None if queues is None else int(queues)


def slot_environment(target: GpuTarget | None, plan: RankPlan, queues: Queues) -> dict[str, str]:
    """What a farm's slot gives each task it runs: its GPU (``MPSRUN_GPU``, its position) and MPS variables with the
    slot's limits, and ``--queues``. No place in an MPI world: a task is a program of its own."""
    if target is None:
        return {}
    env = {**rank_environment(target, plan), "MPSRUN_GPU": str(plan.gpu)}
    count = rank_queues(queues, plan.clients, "CUDA_MPS_PIPE_DIRECTORY" in env)
    if count is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(count)
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
