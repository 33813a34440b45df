"""What frameworks need when several ranks share one GPU, and what their failures there mean.

* JAX preallocates 75% of a GPU's memory in every process: ranks that share a GPU with no memory limit each
  split that share (``XLA_PYTHON_CLIENT_MEM_FRACTION``), or every rank after the first fails out of memory.
* NCCL refuses two ranks on one GPU ("invalid usage"). Its own word for it ("Duplicate GPU detected") is a
  warning, printed only with ``NCCL_DEBUG`` set: ranks that share a GPU log NCCL's warnings into the session
  directory, and a rank that fails after NCCL said so is summed up in one line.

Each group of variables is given only where the rank's environment has none of its names: the caller's
settings always win.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from mpsrun.runtime.constants import SESSION_DIR_VARIABLE

__all__ = ["JAX_PREALLOCATION", "NCCL_ON_A_SHARED_GPU", "failure_reason", "shared_gpu_defaults"]

#: The share of a GPU's memory JAX (XLA) preallocates in a process unless told otherwise.
JAX_PREALLOCATION = 0.75
#: Where NCCL's warnings go (NCCL puts the host's name for %h and the process's pid for %p).
NCCL_LOG = "nccl.%h.%p.log"
#: What NCCL warns when two ranks of one communicator use the same GPU.
NCCL_DUPLICATE_GPU = "Duplicate GPU detected"
NCCL_ON_A_SHARED_GPU = ("NCCL cannot put several ranks on one GPU (NCCL: duplicate GPU); use the gloo backend, "
                        "or one rank per GPU")


def shared_gpu_defaults(env: Mapping[str, str], sharers: int | None) -> list[dict[str, str]]:
    """The groups of variables a rank gets unless its environment has one of a group's names. ``env``: what mpsrun
    gives the rank; ``sharers``: how many of the node's ranks use its GPU, when known."""
    if "CUDA_VISIBLE_DEVICES" not in env or (sharers or 1) < 2:
        return []
    assert sharers is not None
    groups = []
    if "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env:  # with a limit, JAX takes 75% of the rank's limit
        fraction = math.floor(JAX_PREALLOCATION * 1000 / sharers) / 1000
        groups.append({"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.3f}"})
    if env.get(SESSION_DIR_VARIABLE):
        groups.append({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": os.path.join(env[SESSION_DIR_VARIABLE], NCCL_LOG)})
    return groups


def failure_reason(env: Mapping[str, str]) -> str:
    """Why a rank with this environment failed, when a framework said so where mpsrun can read it; else ``""``."""
    log = env.get("NCCL_DEBUG_FILE", "")
    if not env.get(SESSION_DIR_VARIABLE) or os.path.dirname(log) != env[SESSION_DIR_VARIABLE]:
        return ""  # not the log mpsrun asked for
    log_dir = env[SESSION_DIR_VARIABLE]
    prefix, _, suffix = NCCL_LOG.partition("%h.%p")  # (pathlib costs every supervisor's start more than this)
    try:
        names = [name for name in os.listdir(log_dir) if name.startswith(prefix) and name.endswith(suffix)]
    except OSError:
        return ""
    for name in names:
        try:
            with open(os.path.join(log_dir, name), errors="replace") as text:
                if any(NCCL_DUPLICATE_GPU in line for line in text):
                    return NCCL_ON_A_SHARED_GPU
        except OSError:
            continue
    return ""
