"""A worker's MPS variables: which GPUs it sees, which daemon serves it, and its limits.

Pure functions, no I/O. The launcher's ranks (through :func:`mpsrun.job.placement.rank_environment`),
node keepers' ranks and ``mps_session().env()`` all get their MPS variables from :func:`worker_variables`.
"""

from __future__ import annotations

from typing import NamedTuple

from mpsrun.config.values import mib_text
from mpsrun.runtime.constants import SESSION_DIR_VARIABLE

__all__ = ["MANAGED_VARIABLES", "GpuTarget", "client_variables", "worker_variables"]

#: Variables mpsrun owns in a worker: a stale value from the caller's environment is never passed on.
MANAGED_VARIABLES = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_CLIENT_PRIORITY",
    SESSION_DIR_VARIABLE,
)


class GpuTarget(NamedTuple):
    """The GPUs a worker reaches: ``visible`` (its GPU's UUID, or under ``gpu_bind="none"`` every session GPU's,
    comma-separated), how many (``devices``) and the SMs of the smallest (``multiprocessors``, where known) and,
    under MPS, the directories of the daemon that serves them."""

    visible: str
    pipe_dir: str | None = None
    log_dir: str | None = None
    session_dir: str | None = None
    devices: int = 1
    multiprocessors: int | None = None


def client_variables(thread_percentage: int | None, mem_limit: int | None, priority: int | None,
                     devices: int = 1) -> dict[str, str]:
    """The MPS client variables for these (validated) limits; unset limits are left out.

    The memory limit applies to each of the client's ``devices`` (one, unless workers see every GPU).
    """
    env: dict[str, str] = {}
    if thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    if mem_limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{d}={mib_text(mem_limit)}" for d in range(devices))
    if priority is not None:
        env["CUDA_MPS_CLIENT_PRIORITY"] = str(priority)
    return env


def worker_variables(target: GpuTarget, thread_percentage: int | None = None, mem_limit: int | None = None,
                     priority: int | None = None) -> dict[str, str]:
    """A worker's GPUs and, when its GPU has a daemon, the daemon's directories and the worker's limits."""
    env = {"CUDA_VISIBLE_DEVICES": target.visible}
    if target.pipe_dir is None:
        return env
    env["CUDA_MPS_PIPE_DIRECTORY"] = target.pipe_dir
    env["CUDA_MPS_LOG_DIRECTORY"] = target.log_dir or target.pipe_dir
    if target.session_dir is not None:
        env[SESSION_DIR_VARIABLE] = target.session_dir
    env.update(client_variables(thread_percentage, mem_limit, priority, target.devices))
    return env
