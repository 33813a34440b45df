"""Rank placement: which GPU and which MPS limits each rank gets. Pure functions, no I/O.

:func:`plan_ranks` is checked before anything starts; :func:`rank_environments` turns
the plan plus each GPU's session variables into one environment dict per rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import attrs

from mpsrun.errors import ConfigError
from mpsrun.limits import client_variables, parse_mem_limit, parse_priority, parse_thread_percentage

__all__ = ["MAP_POLICIES", "RankPlan", "parse_thread_spec", "plan_ranks", "rank_environments"]

MAP_POLICIES = ("block", "round-robin")
ThreadSpec = None | str | int | Sequence[int]


@attrs.frozen
class RankPlan:
    """Where one rank runs: its GPU (position in the session's GPU list) and its limits."""

    rank: int
    gpu: int
    thread_percentage: int | None
    mem_limit: str | None
    priority: int | None


def parse_thread_spec(text: str, setting: str = "--thread-percentage") -> ThreadSpec:
    """``--thread-percentage`` text: ``auto``, ``P`` or ``P0,P1,...`` (one per rank)."""
    text = text.strip()
    if text.lower() == "auto":
        return "auto"
    parts = [part.strip() for part in text.split(",")]
    values = [parse_thread_percentage(part, setting=setting) for part in parts]
    return values[0] if len(values) == 1 else values


def gpu_of_rank(rank: int, nranks: int, ngpus: int, policy: str) -> int:
    """``block``: contiguous, even chunks of ranks per GPU; ``round-robin``: rank modulo GPUs."""
    if policy == "block":
        return rank * ngpus // nranks
    return rank % ngpus


def plan_ranks(
    nranks: int,
    ngpus: int,
    policy: str = "block",
    thread_percentage: ThreadSpec = None,
    mem_limit: str | None = None,
    priority: int | None = None,
) -> list[RankPlan]:
    """Place ``nranks`` ranks on ``ngpus`` GPUs; reject impossible requests with ConfigError.

    ``thread_percentage`` is None (no cap), an int for every rank, ``"auto"`` (100 divided
    by the number of ranks sharing that GPU) or a list with one value per rank.
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ConfigError(f"the number of ranks must be a positive integer, not {nranks!r}", setting="-np")
    if ngpus < 1:
        raise ConfigError("there is no GPU to place ranks on", setting="--gpus")
    if policy not in MAP_POLICIES:
        raise ConfigError(f"--map-by must be block or round-robin, not {policy!r}", setting="--map-by", value=policy)
    gpus = [gpu_of_rank(rank, nranks, ngpus, policy) for rank in range(nranks)]
    sharing = Counter(gpus)
    if thread_percentage is None:
        percentages: list[int | None] = [None] * nranks
    elif thread_percentage == "auto":
        percentages = [max(1, 100 // sharing[gpu]) for gpu in gpus]
    elif isinstance(thread_percentage, (int, str)):
        percentages = [parse_thread_percentage(thread_percentage, setting="--thread-percentage")] * nranks
    else:
        values = list(thread_percentage)
        if len(values) != nranks:
            raise ConfigError(
                f"--thread-percentage lists {len(values)} values but there are {nranks} ranks; "
                "give one value per rank, a single value, or auto",
                setting="--thread-percentage",
                value=values,
            )
        percentages = [parse_thread_percentage(v, setting="--thread-percentage") for v in values]
    limit = None if mem_limit is None else parse_mem_limit(mem_limit, setting="--mem-limit")
    level = None if priority is None else parse_priority(priority, setting="--priority")
    return [
        RankPlan(rank=rank, gpu=gpus[rank], thread_percentage=percentages[rank], mem_limit=limit, priority=level)
        for rank in range(nranks)
    ]


def rank_environments(plan: Sequence[RankPlan], gpu_envs: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """One environment dict per rank: its GPU's session variables, its limits, its rank variables.

    ``gpu_envs[i]`` holds GPU i's variables from the session (``CUDA_VISIBLE_DEVICES``
    and, under MPS, the pipe and log directories); limits are set only under MPS.
    """
    world = len(plan)
    local_world = str(world)  # one node: every rank is local
    envs: list[dict[str, str]] = []
    for entry in plan:
        gpu_env = gpu_envs[entry.gpu]
        env = dict(gpu_env)
        if "CUDA_MPS_PIPE_DIRECTORY" in gpu_env:
            env.update(client_variables(entry.thread_percentage, entry.mem_limit, entry.priority))
        env.update(
            RANK=str(entry.rank),
            LOCAL_RANK=str(entry.rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=local_world,
            MPSRUN_RANK=str(entry.rank),
            MPSRUN_GPU=str(entry.gpu),
        )
        envs.append(env)
    return envs
