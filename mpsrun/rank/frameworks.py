"""What frameworks need from a launcher and on a shared GPU, and what their failures there mean.

* torchrun gives each worker its group (node), role and restart variables besides ``RANK`` and ``LOCAL_RANK``;
  Lightning and torchelastic-aware code take a job for torchrun's only when the set is complete.
* JAX preallocates 75% of a GPU's memory in every process: ranks that share a GPU with no memory limit each
  split that share (``XLA_PYTHON_CLIENT_MEM_FRACTION``), or every rank after the first fails out of memory.
* NCCL 2.30 and later put several ranks on one GPU when ``NCCL_MULTI_RANK_GPU_ENABLE=1``; older ones refuse
  ("Duplicate GPU detected", a warning printed only with ``NCCL_DEBUG`` set, so ranks that share a GPU log NCCL's
  warnings into the session directory). Under MPS the collective's blocks of every rank must be on the GPU at once
  (each spins until its peers' have run, one NCCL block an SM), so more blocks in all than SMs wait for each other
  forever: ``NCCL_MAX_CTAS`` caps each rank's.
* CUDA 12.9 and later write every failed call to ``CUDA_LOG_FILE``: a rank that fails is summed up with CUDA's own
  word for its last error (a device it cannot see, its MPS client ended).

Each variable or group of variables is given only where the rank's environment has none of its names: the
caller's settings win. torchrun's layout (where a rank is) is the rank's own, as ``RANK`` is.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from mpsrun.runtime.constants import MOST_QUEUES, MPS_CLIENT_LIMIT, SESSION_DIR_VARIABLE
from mpsrun.runtime.files import read_log

__all__ = [
    "JAX_PREALLOCATION",
    "failure_reason",
    "nccl_block_cap",
    "queue_overflow",
    "rank_defaults",
    "shared_gpu_defaults",
    "torchrun_layout",
]

#: The share of a GPU's memory JAX (XLA) preallocates in a process unless told otherwise.
JAX_PREALLOCATION = 0.75
#: Where NCCL's warnings go (NCCL puts the host's name for %h and the process's pid for %p).
NCCL_LOG = "nccl.%h.%p.log"
#: Where CUDA's error log of rank N goes (CUDA puts nothing in the name: one file a rank).
CUDA_LOG = "cuda.{rank}.log"
#: NCCL_MAX_CTAS: at most this many blocks a rank (NCCL's channels), and as many as fit where the GPU's SMs are not
#: known. Each rank gets half the SMs its share allows, so two collectives of every rank at once still fit.
NCCL_MOST_BLOCKS = 32
ASSUMED_SMS = 16
#: The first NCCL that can put several ranks on one GPU.
NCCL_MULTI_RANK = (2, 30)


def torchrun_layout(rank: int, world_size: int | None, local_world_size: int | None) -> dict[str, str]:
    """Where torchrun's variables put a worker, mpsrun's own as ``RANK`` is (a caller's value, one for every rank,
    would be wrong in all but one): its role's rank and size, and the node's index and count as torchrun's layout
    has them (the same number of consecutive ranks on every node)."""
    env = {"ROLE_RANK": str(rank)}
    if world_size is not None:
        env["ROLE_WORLD_SIZE"] = str(world_size)
        if local_world_size:
            env["GROUP_RANK"] = str(rank // local_world_size)
            env["GROUP_WORLD_SIZE"] = str(math.ceil(world_size / local_world_size))
    return env


#: What else torchrun gives a worker, each unless the caller set it: one role, torchrun's run id when none is given,
#: and no restarts.
TORCHRUN_DEFAULTS = {"ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                     "TORCHELASTIC_MAX_RESTARTS": "0"}


def nccl_block_cap(multiprocessors: int | None, sharers: int, thread_percentage: int | None = None) -> int:
    """``NCCL_MAX_CTAS`` for one of ``sharers`` ranks on a GPU of ``multiprocessors`` SMs under MPS, each capped at
    ``thread_percentage`` of them: half its share of the SMs, so that every rank's blocks fit on the GPU at once."""
    sms = multiprocessors or ASSUMED_SMS
    share = sms // max(1, sharers)
    if thread_percentage is not None:
        share = min(share, sms * thread_percentage // 100)
    return max(1, min(NCCL_MOST_BLOCKS, share // 2))


def shared_gpu_defaults(env: Mapping[str, str], sharers: int | None,
                        multiprocessors: int | None = None) -> list[dict[str, str]]:
    """The groups of variables a rank gets unless its environment has one of a group's names. ``env``: what mpsrun
    gives the rank; ``sharers``: how many of the node's ranks use its GPU, when known; ``multiprocessors``: its SMs."""
    if "CUDA_VISIBLE_DEVICES" not in env or (sharers or 1) < 2:
        return []
    assert sharers is not None
    groups = []
    if "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env:  # with a limit, JAX takes 75% of the rank's limit
        fraction = math.floor(JAX_PREALLOCATION * 1000 / sharers) / 1000
        groups.append({"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.3f}"})
    if env.get(SESSION_DIR_VARIABLE):
        groups.append({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": os.path.join(env[SESSION_DIR_VARIABLE], NCCL_LOG)})
    groups.append({"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    if "CUDA_MPS_PIPE_DIRECTORY" in env:  # time-sliced ranks never run their blocks at once: no cap needed
        percentage = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        cap = nccl_block_cap(multiprocessors, sharers, int(percentage) if percentage else None)
        groups.append({"NCCL_MAX_CTAS": str(cap)})
    return groups


def rank_defaults(env: Mapping[str, str], rank: int) -> list[dict[str, str]]:
    """What every rank gets unless set: CUDA's error log in the session directory (``env``: what mpsrun gives it)."""
    if not env.get(SESSION_DIR_VARIABLE):
        return []
    return [{"CUDA_LOG_FILE": os.path.join(env[SESSION_DIR_VARIABLE], CUDA_LOG.format(rank=rank))}]


def failure_reason(env: Mapping[str, str], gpu_clients: int | None = None, gpu_queues: int | None = None) -> str:
    """Why a rank with this environment failed: its GPU's MPS clients asked more hardware queues than the GPU has
    (``gpu_queues`` among ``gpu_clients``), or what CUDA or NCCL said where mpsrun asked them to; else ``""``."""
    device, error = _cuda_reasons(env)  # a device that does not exist fails before any queue is asked for
    return device or queue_overflow(env, gpu_clients, gpu_queues) or error or _nccl_reason(env)


def queue_overflow(env: Mapping[str, str], clients: int | None, queues: int | None) -> str:
    """The GPU's ``clients`` each asked the rank's CUDA_DEVICE_MAX_CONNECTIONS, more than its ``queues`` in all: some
    cannot create a CUDA context (their error says only "out of memory", or that the server ended them). "" else.
    Only as many clients as an MPS server takes count: beyond them the server's limit is the cause, which its log
    says. The way out names no more queues than ``--queues`` takes."""
    try:
        each = int(env.get("CUDA_DEVICE_MAX_CONNECTIONS", ""))
    except ValueError:
        return ""
    served = min(clients, MPS_CLIENT_LIMIT) if clients is not None else None
    if served is None or queues is None or each * served <= queues:
        return ""
    return (f"{served} MPS clients on one GPU asked {each} hardware queues each "
            f"(CUDA_DEVICE_MAX_CONNECTIONS), {each * served} in all, more than the {queues} a GPU has under MPS, so "
            f"some could not create a CUDA context: give mpsrun --queues auto to plan them, or --queues "
            f"{min(queues // served, MOST_QUEUES)} or fewer")


def _our_log(env: Mapping[str, str], name: str) -> str | None:
    """The log ``name`` names in ``env`` when it is one mpsrun asked for (in the session directory), else None."""
    path, session = env.get(name, ""), env.get(SESSION_DIR_VARIABLE)
    return path if session and os.path.dirname(path) == session else None


def _tail(path: str, size: int = 1 << 16) -> str:
    """The last ``size`` bytes of a file as text ("" when it cannot be read)."""
    try:
        return read_log(path, last=size).decode(errors="replace")
    except OSError:
        return ""


#: CUDA's error log: "[time][thread][CUDA][E] Returning 810 (CUDA_ERROR_MPS_CLIENT_TERMINATED) from
#: cuCtxSynchronize_v2", and for a device number out of range (the runtime's check, before any driver call)
#: "Invalid device number 1 provided, must be in the range of 0 to 0" (both recorded on an H100, driver 580).
_CUDA_LINE = re.compile(r"Returning \d+ \((CUDA_ERROR_\w+)\) from (\w+)|Invalid device number (\d+) provided, "
                        r"must be in the range of 0 to (\d+)")
_CUDA_ERRORS = {
    "CUDA_ERROR_MPS_CLIENT_TERMINATED": "the MPS server ended its CUDA client",
    "CUDA_ERROR_MPS_RPC_FAILURE": "it lost its MPS server",
    "CUDA_ERROR_MPS_CONNECTION_FAILED": "it could not connect to its MPS server",
    "CUDA_ERROR_MPS_SERVER_NOT_READY": "its MPS server was not ready",
    "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED": "its MPS server had as many clients as it takes",
    "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED": "its MPS server had no connection left for it",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "a kernel touched memory it may not",
}


def _cuda_reasons(env: Mapping[str, str]) -> tuple[str, str]:
    """CUDA's word, from the rank's CUDA log, for a device it asked for and does not see, and for its last error that
    mpsrun can explain ("" for either it did not say)."""
    path = _our_log(env, "CUDA_LOG_FILE")
    device = error = ""
    for match in _CUDA_LINE.finditer(_tail(path) if path else ""):
        code, call, number, last = match.groups()
        if number is not None:
            device = _no_such_device(env, int(number), int(last) + 1)
        elif code in _CUDA_ERRORS:
            error = f"CUDA said {code} ({call}): {_CUDA_ERRORS[code]}"
    return device, error


def _no_such_device(env: Mapping[str, str], device: int, seen: int) -> str:
    said = f"it asked CUDA for device {device} and sees {seen} GPU{'s' * (seen != 1)}"
    if env.get("LOCAL_RANK") == str(device):
        said += (" (LOCAL_RANK as a device index): run with --gpu-bind none for one rank per GPU, or --local-rank "
                 "device where ranks share a GPU")
    return said


_NCCL_VERSION = re.compile(r"NCCL version (\d+)\.(\d+)\.(\d+)")
#: What NCCL warns when it will not put two ranks of one communicator on one GPU: before 2.30, and from 2.30 on
#: without NCCL_MULTI_RANK_GPU_ENABLE=1 (src/init.cc).
_NCCL_REFUSALS = ("Duplicate GPU detected", "NCCL_MULTI_RANK_GPU_ENABLE")


def _nccl_reason(env: Mapping[str, str]) -> str:
    """Why NCCL refused the rank, from the warnings of the node's ranks in the session directory."""
    path = _our_log(env, "NCCL_DEBUG_FILE")
    if path is None:
        return ""
    prefix, _, suffix = NCCL_LOG.partition("%h.%p")  # (pathlib costs every supervisor's start more than this)
    try:
        names = [name for name in os.listdir(env[SESSION_DIR_VARIABLE]) if name.startswith(prefix)
                 and name.endswith(suffix)]
    except OSError:
        return ""
    texts = [_tail(os.path.join(env[SESSION_DIR_VARIABLE], name)) for name in names]
    refused = [refusal for refusal in _NCCL_REFUSALS if any(refusal in text for text in texts)]
    if not refused:
        return ""
    found = next((match.groups() for text in texts if (match := _NCCL_VERSION.search(text))), None)  # rank 0's
    can_share = tuple(map(int, found[:2])) >= NCCL_MULTI_RANK if found else _NCCL_REFUSALS[-1] in refused
    if can_share:
        named = f"NCCL {'.'.join(found)}" if found else "This NCCL"
        return f"{named} puts several ranks on one GPU only with NCCL_MULTI_RANK_GPU_ENABLE=1"
    named = f"NCCL {'.'.join(found)}" if found else "NCCL older than 2.30"
    return (f"{named} cannot put several ranks on one GPU; NCCL 2.30 or newer can (pip install "
            "'nvidia-nccl-cu13>=2.30', docs/frameworks.md), or use the gloo backend")
