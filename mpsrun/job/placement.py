"""Placement: which GPU and limits each rank gets, the daemons' defaults, and the one rank environment.

Pure functions, no I/O. Every path (local ranks, ranks under mpiexec, per-node ranks) gets its
variables from :func:`rank_environment`, through :func:`welcome`; the launcher and node keepers give
their daemons :func:`daemon_defaults`, from the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mpsrun.config.options import JobConfig
from mpsrun.errors import ConfigError
from mpsrun.mps.environment import MANAGED_VARIABLES, GpuTarget, worker_variables
from mpsrun.mps.limits import DaemonDefaults, auto_mem_limits
from mpsrun.rank.frameworks import TORCHRUN_DEFAULTS, rank_defaults, shared_gpu_defaults, torchrun_layout
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import (
    CONTROL_VARIABLES,
    JOB_ID_VARIABLE,
    LAUNCHER_PREFIXES,
    LAUNCHER_REWRITES,
    SESSION_DIR_VARIABLE,
)
from mpsrun.runtime.protocol import Welcome

__all__ = ["Admission", "RankPlan", "daemon_defaults", "gpu_of_rank", "plan_job", "plan_rank", "rank_environment",
           "ranks_on_gpus", "ranks_per_gpu", "welcome", "without_mps"]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Where one rank runs: its GPU (position in the session's list) and its limits."""

    rank: int
    gpu: int
    thread_percentage: int | None = None
    mem_limit: str | None = None
    priority: int | None = None
    sharers: int | None = None  # the node's ranks on its GPU (under --gpu-bind none: spread evenly), when known


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


def _mem_limits(config: JobConfig, local_size: int | None, ngpus: int, free: Sequence[int]) -> list[str | None]:
    """The pinned memory limit of each GPU position (``free``: each GPU's free bytes; empty without MPS)."""
    if config.mem_limit != "auto":
        return [config.mem_limit] * max(ngpus, 1)
    if not free:
        return [None] * max(ngpus, 1)
    return auto_mem_limits(free, _sharing(config, local_size, len(free), "--mem-limit"), config.gpu_bind == "none")


def _percentage(config: JobConfig, identity: RankIdentity, gpu: int, ngpus: int) -> int | None:
    spec = config.thread_percentage
    if spec is None or isinstance(spec, int):
        return spec
    if spec == "auto":
        return max(1, 100 // _sharing(config, identity.local_world_size, ngpus, "--thread-percentage")[gpu])
    assert isinstance(spec, tuple)
    world = identity.world_size
    if (world is not None and len(spec) != world) or identity.rank >= len(spec):
        raise ConfigError(f"--thread-percentage lists {len(spec)} values but there are {world or 'more'} ranks; "
                          "give one value per rank, a single value, or auto", setting="--thread-percentage", value=spec)
    return spec[identity.rank]


def plan_rank(identity: RankIdentity, ngpus: int, config: JobConfig, free: Sequence[int] = ()) -> RankPlan:
    """One rank's GPU and limits; raises ConfigError for what cannot be honoured.

    ``free``: each GPU's free memory in bytes (for ``--mem-limit auto``). Under ``--gpu-bind
    none`` every rank has GPU position 0: the one daemon, which serves all the GPUs.
    """
    if ngpus < 1:
        return RankPlan(identity.rank, 0, None, _mem_limits(config, identity.local_world_size, 0, ())[0],
                        config.priority)
    local_size = identity.local_world_size
    gpu = 0 if config.gpu_bind == "none" else gpu_of_rank(identity.local_rank, local_size, ngpus, config.map_by)
    sharers = None if local_size is None else _sharing(config, local_size, ngpus, "")[gpu]
    return RankPlan(identity.rank, gpu, _percentage(config, identity, gpu, ngpus),
                    _mem_limits(config, local_size, ngpus, free)[gpu], config.priority, sharers)


def plan_job(nranks: int, ngpus: int, config: JobConfig, free: Sequence[int] = ()) -> list[RankPlan]:
    """Every rank of a one-node job (all ranks local), checked before anything starts."""
    return [plan_rank(RankIdentity(r, r, nranks, nranks), ngpus, config, free) for r in range(nranks)]


def daemon_defaults(config: JobConfig, ngpus: int, local_size: int | None, free: Sequence[int]) -> DaemonDefaults:
    """What the node's daemons apply to a client that sets no limit itself: the highest cap any rank has (none
    when some rank has none), and each GPU's memory limit. ``local_size``: the ranks on this node, when known."""
    spec, cap = config.thread_percentage, None
    if isinstance(spec, int):
        cap = spec
    elif isinstance(spec, tuple):
        cap = max(spec)
    elif spec == "auto" and local_size is not None and ngpus:
        cap = max(max(1, 100 // n) for n in _sharing(config, local_size, ngpus, "--thread-percentage") if n)
    known = config.mem_limit != "auto" or local_size is not None
    return DaemonDefaults(cap, tuple(_mem_limits(config, local_size, ngpus, free if known else ())))


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
                                       ("--mem-limit", config.mem_limit), ("--priority", config.priority))
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


class Admission(NamedTuple):
    """A rank's welcome, and for its controller (not sent) the rank's GPU position and that GPU's ranks when it
    shares the GPU with no memory limit (a failure out of memory then names the sharing)."""

    welcome: Welcome
    unlimited_gpu: tuple[int, int] | None


def welcome(identity: RankIdentity, config: JobConfig, ngpus: int, target_of: Callable[[int], GpuTarget | None],
            mpi4py_abort: bool, free: Sequence[int] = (), session_dir: str | None = None,
            output_lock: str | None = None, callers: Mapping[str, str | None] | None = None) -> Admission:
    """What a rank's supervisor is told when it says hello: the rank's variables and how to run it.

    ``free``: each GPU's free memory under MPS (for ``--mem-limit auto``). ``session_dir``: the job's (or
    node's) private directory, also without MPS (:mod:`mpsrun.shared` keeps its handles there).
    ``mpi4py_abort``: whether Python ranks run through mpi4py's runner (mpi4py is installed, and not off).
    ``callers``: :func:`callers_values` of the environment the job was started from, when this process has it (the
    ``mpsrun`` command, not a node keeper): what an MPI launcher rewrote of it is put back.
    """
    plan = plan_rank(identity, ngpus, config, free)
    target = target_of(plan.gpu) if ngpus else None
    env = rank_environment(target, plan, identity, _device_number(identity, config, ngpus))
    if session_dir is not None:
        env.setdefault(SESSION_DIR_VARIABLE, session_dir)
    restore: dict[str, str | None] = {}
    if callers is not None:
        restore.update(callers)
    for item in config.exports:  # -x: resolved where the command line was read
        name, given, value = item.partition("=")
        restore[name] = value if given else None
    defaults = [{name: value} for name, value in TORCHRUN_DEFAULTS.items()]  # each alone: one the caller set wins
    defaults += shared_gpu_defaults(env, plan.sharers, target.multiprocessors if target else None)
    defaults += rank_defaults(env, identity.rank)
    sent = Welcome(env, defaults, list(MANAGED_VARIABLES), restore, config.tag_output, config.grace, config.timeout,
                   mpi4py_abort, output_lock, config.output_filename, [])
    return Admission(sent, _unlimited_gpu(plan, ngpus))


def _device_number(identity: RankIdentity, config: JobConfig, ngpus: int) -> int | None:
    """LOCAL_RANK under ``--local-rank device``: a device the rank can use (its one GPU is device 0; seeing every
    GPU, the rank's place on the node modulo the GPUs); None: LOCAL_RANK is the rank's place on its node."""
    if config.local_rank != "device":
        return None
    return 0 if config.gpu_bind == "single" or ngpus < 1 else identity.local_rank % ngpus


def _unlimited_gpu(plan: RankPlan, ngpus: int) -> tuple[int, int] | None:
    if ngpus and plan.sharers is not None and plan.sharers > 1 and plan.mem_limit is None:
        return plan.gpu, plan.sharers
    return None
