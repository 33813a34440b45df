"""Placement: which GPU and limits each rank gets, and the one function that builds its environment.

Pure functions, no I/O. Every path (local ranks, ranks under mpiexec, per-node ranks,
``mps_session().env()``) gets its variables from :func:`rank_environment`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpsrun.config.options import JobConfig
from mpsrun.config.values import auto_mem_limit, client_variables
from mpsrun.errors import ConfigError
from mpsrun.job.mpiexec import mpi4py_available
from mpsrun.rank.identity import RankIdentity

__all__ = [
    "MANAGED_VARIABLES",
    "GpuTarget",
    "RankPlan",
    "gpu_of_rank",
    "plan_job",
    "plan_rank",
    "rank_environment",
    "ranks_on_gpus",
    "welcome",
    "without_mps",
]

#: Variables mpsrun owns in a rank: a stale value from the caller's environment is never passed on.
MANAGED_VARIABLES = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_CLIENT_PRIORITY",
    "MPSRUN_SESSION_DIR",
)


@dataclass(frozen=True, slots=True)
class GpuTarget:
    """The GPUs a rank reaches: ``visible`` (its GPU's UUID, or under ``--gpu-bind none`` every job GPU's,
    comma-separated) and, under MPS, the directories of the daemon that serves them."""

    visible: str
    pipe_dir: str | None = None
    log_dir: str | None = None
    session_dir: str | None = None
    devices: int = 1


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Where one rank runs: its GPU (position in the session's list) and its limits."""

    rank: int
    gpu: int
    thread_percentage: int | None = None
    mem_limit: str | None = None
    priority: int | None = None


def gpu_of_rank(local_rank: int, local_size: int | None, ngpus: int, policy: str) -> int:
    """``block``: even runs of consecutive ranks per GPU; ``round-robin``: rank modulo GPUs."""
    if ngpus == 1:
        return 0
    if policy == "round-robin":
        return local_rank % ngpus
    if local_size is None:
        raise ConfigError(
            "--map-by block needs the number of ranks on this node, and the launcher does not say it; "
            "use --map-by round-robin",
            setting="--map-by",
        )
    return min(ngpus - 1, local_rank * ngpus // local_size)


def _sharing(gpu: int, local_size: int | None, ngpus: int, config: JobConfig, option: str) -> int:
    """How many ranks share a GPU, for the auto limits (under --gpu-bind none: the ranks spread evenly)."""
    if local_size is None:
        raise ConfigError(
            f"{option} auto needs the number of ranks on this node, and the launcher does not say it; "
            "give a value",
            setting=option,
        )
    if config.gpu_bind == "none":
        return -(-local_size // ngpus)
    return sum(gpu_of_rank(r, local_size, ngpus, config.map_by) == gpu for r in range(local_size))


def _percentage(config: JobConfig, identity: RankIdentity, gpu: int, ngpus: int) -> int | None:
    spec = config.thread_percentage
    if spec is None or isinstance(spec, int):
        return spec
    if spec == "auto":
        return max(1, 100 // _sharing(gpu, identity.local_world_size, ngpus, config, "--thread-percentage"))
    assert isinstance(spec, tuple)
    world = identity.world_size
    if (world is not None and len(spec) != world) or identity.rank >= len(spec):
        raise ConfigError(
            f"--thread-percentage lists {len(spec)} values but there are {world if world else 'more'} ranks; "
            "give one value per rank, a single value, or auto",
            setting="--thread-percentage",
            value=spec,
        )
    return spec[identity.rank]


def _mem_limit(config: JobConfig, identity: RankIdentity, gpu: int, free: Sequence[int]) -> str | None:
    """The rank's pinned memory limit; ``auto`` splits its GPU's ``free`` bytes (None when unknown: no GPU)."""
    if config.mem_limit != "auto":
        return config.mem_limit
    if not free:
        return None
    sharing = _sharing(gpu, identity.local_world_size, len(free), config, "--mem-limit")
    if config.gpu_bind == "none":  # one limit for every device: the tightest GPU decides
        return auto_mem_limit(min(free), sharing, "each GPU")
    return auto_mem_limit(free[gpu], sharing, f"GPU {gpu}")


def plan_rank(identity: RankIdentity, ngpus: int, config: JobConfig, free: Sequence[int] = ()) -> RankPlan:
    """One rank's GPU and limits; raises ConfigError for what cannot be honoured.

    ``free``: each GPU's free memory in bytes (for ``--mem-limit auto``). Under ``--gpu-bind
    none`` every rank has GPU position 0: the one daemon, which serves all the GPUs.
    """
    if ngpus < 1:
        return RankPlan(identity.rank, 0, None, _mem_limit(config, identity, 0, ()), config.priority)
    gpu = 0 if config.gpu_bind == "none" else gpu_of_rank(identity.local_rank, identity.local_world_size, ngpus,
                                                          config.map_by)
    return RankPlan(identity.rank, gpu, _percentage(config, identity, gpu, ngpus),
                    _mem_limit(config, identity, gpu, free), config.priority)


def plan_job(nranks: int, ngpus: int, config: JobConfig, free: Sequence[int] = ()) -> list[RankPlan]:
    """Every rank of a one-node job (all ranks local), checked before anything starts."""
    return [plan_rank(RankIdentity(r, r, nranks, nranks), ngpus, config, free) for r in range(nranks)]


def rank_environment(
    target: GpuTarget | None, plan: RankPlan | None, identity: RankIdentity | None = None
) -> dict[str, str]:
    """The variables mpsrun gives one rank or worker.

    ``target`` is its GPU (None: no GPU known, e.g. no driver); its MPS limits apply only
    when the GPU has a daemon; ``identity`` adds the rank variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` where known).
    """
    env: dict[str, str] = {}
    if target is not None:
        env["CUDA_VISIBLE_DEVICES"] = target.visible
        if target.pipe_dir is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = target.pipe_dir
            env["CUDA_MPS_LOG_DIRECTORY"] = target.log_dir or target.pipe_dir
            if target.session_dir is not None:
                env["MPSRUN_SESSION_DIR"] = target.session_dir
            if plan is not None:
                env.update(client_variables(plan.thread_percentage, plan.mem_limit, plan.priority, target.devices))
    if identity is not None:
        if plan is not None and target is not None:
            env["MPSRUN_GPU"] = str(plan.gpu)
        env.update(RANK=str(identity.rank), LOCAL_RANK=str(identity.local_rank), MPSRUN_RANK=str(identity.rank))
        if identity.world_size is not None:
            env["WORLD_SIZE"] = str(identity.world_size)
        if identity.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(identity.local_world_size)
    return env


def ranks_on_gpus(plans: Sequence[RankPlan]) -> dict[int, int]:
    """GPU position -> number of ranks placed on it."""
    counts: dict[int, int] = {}
    for plan in plans:
        counts[plan.gpu] = counts.get(plan.gpu, 0) + 1
    return counts


def without_mps(config: JobConfig, reason: str) -> list[str]:
    """What to say once when the ranks run without MPS: why, and which options then have no effect."""
    unused = [flag for flag, value in (("--thread-percentage", config.thread_percentage),
                                       ("--mem-limit", config.mem_limit), ("--priority", config.priority))
              if value is not None]
    lines = [f"running without MPS: {reason}"]
    if unused:
        lines.append(f"warning: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without MPS")
    return lines


def welcome(
    identity: RankIdentity, config: JobConfig, ngpus: int, target_of: Callable[[int], GpuTarget | None],
    output_lock: str | None = None, free: Sequence[int] = (), session_dir: str | None = None,
) -> dict[str, Any]:
    """What a rank's supervisor is told when it says hello: the rank's variables and how to run it.

    ``free``: each GPU's free memory under MPS (for ``--mem-limit auto``). ``session_dir``: the job's (or
    node's) private directory, also without MPS (:mod:`mpsrun.shared.api` keeps its handles there).
    """
    plan = plan_rank(identity, ngpus, config, free)
    env = rank_environment(target_of(plan.gpu) if ngpus else None, plan, identity)
    if session_dir is not None:
        env.setdefault("MPSRUN_SESSION_DIR", session_dir)
    return {
        "env": env,
        "managed": list(MANAGED_VARIABLES),
        "tag": config.tag_output,
        "grace": config.grace,
        # Asked here, where site-packages are on the path (the shim starts without them).
        "mpi4py_abort": config.mpi4py_abort == "on" and mpi4py_available(),
        "output_lock": output_lock,
    }
