"""What MPI launchers and batch systems tell a process about its place in the job.

One table of variables per fact, tried in order (Open MPI, MPICH/Hydra and Intel MPI, PMIx, Cray PALS,
MVAPICH2, Slurm's srun).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from mpsrun.runtime.constants import JOB_ID_VARIABLE

__all__ = ["RankIdentity", "first_int", "identity_from_env", "job_key", "slurm_tasks_on_node"]

#: A process's rank on its node.
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "PALS_LOCAL_RANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)
#: Its rank in the job, the job's size, and how many ranks share its node.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PALS_SIZE", "SLURM_NTASKS")
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
#: What the local ranks of one job share (Slurm is handled first, by job and step).
JOB_VARIABLES = (JOB_ID_VARIABLE, "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMI_JOBID")


def first_int(env: Mapping[str, str], names: Sequence[str]) -> int | None:
    """The first of these variables that holds a whole number (ASCII digits only)."""
    for name in names:
        value = env.get(name, "").strip()
        if value.isascii() and value.isdigit():
            return int(value)
    return None


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node, from Slurm's compressed list (``4(x2),3``) and the node's index."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = first_int(env, ("SLURM_NODEID",))
    if not text or node is None:
        return None
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


class RankIdentity(NamedTuple):
    """A rank's place: its rank, its rank on the node, and the sizes when the launcher says them."""

    rank: int
    local_rank: int
    world_size: int | None = None
    local_world_size: int | None = None

    def impossible(self) -> str | None:
        """What makes this identity impossible (a rank beyond a size the launcher gave), or None."""
        local_size, size = self.local_world_size, self.world_size
        if local_size is not None and self.local_rank >= local_size:
            return f"local rank {self.local_rank} of {local_size} on this node"
        if size is not None and self.rank >= size:
            return f"rank {self.rank} of {size}"
        if local_size is not None and size is not None and local_size > size:
            return f"{local_size} ranks on this node of {size} in all"
        return None

    @classmethod
    def checked(cls, rank: int | None, local_rank: int | None, world_size: int | None = None,
                local_world_size: int | None = None) -> RankIdentity:
        """An identity as a hello gives it; ValueError for one that names no rank, or a negative number."""
        values = {"rank": rank, "local_rank": local_rank, "world_size": world_size,
                  "local_world_size": local_world_size}
        for name, value in values.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a whole number, not {value!r}")
        if rank is None or local_rank is None:
            raise ValueError("a rank identity needs rank and local_rank")
        return cls(rank, local_rank, world_size, local_world_size)


def identity_from_env(env: Mapping[str, str]) -> RankIdentity | None:
    """This process's identity from its launcher's variables; None when no launcher set them."""
    local = first_int(env, LOCAL_RANK_VARIABLES)
    if local is None:
        return None
    rank = first_int(env, RANK_VARIABLES)
    local_size = first_int(env, LOCAL_SIZE_VARIABLES)
    if local_size is None:
        local_size = slurm_tasks_on_node(env)
    return RankIdentity(
        rank=local if rank is None else rank,
        local_rank=local,
        world_size=first_int(env, SIZE_VARIABLES),
        local_world_size=local_size,
    )


def job_key(env: Mapping[str, str]) -> str:
    """What every local rank of one job step shares: Slurm's job and step (and the job's restart: a requeued job
    keeps its id and numbers its steps from 0 again), the MPI job, or the launcher process."""
    if env.get("SLURM_JOB_ID"):
        restart = env.get("SLURM_RESTART_COUNT", "0")
        run = f".r{restart}" if restart != "0" else ""
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}{run}"
    for name in JOB_VARIABLES:
        if env.get(name):
            return f"{name}-{env[name]}"
    return f"ppid-{os.getppid()}"  # MPICH's Hydra names no job; its proxy is the local ranks' shared parent
