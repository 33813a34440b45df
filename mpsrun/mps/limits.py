"""The MPS limits as numbers: ``--mem-limit auto``'s split, and limits as the daemon stores them.

Pure functions. The split is written once, here, for the launcher, node keepers and
``mps_session(mem_limit="auto", workers=N)`` alike; each caller says how many ranks share each GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mpsrun.errors import ConfigError

__all__ = ["GPU_CONNECTIONS", "PLAIN_CONNECTIONS", "SERVER_SHARE_MIB", "DaemonDefaults", "auto_mem_limit",
           "auto_mem_limits", "client_connections", "memory_hint", "stored_mem_limit"]

#: Device memory the MPS server takes (66 MiB measured on an H100), with room to spare.
SERVER_SHARE_MIB = 128
#: Below this a rank's CUDA context alone would not fit.
_SMALLEST_AUTO_MIB = 1024
#: Hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``) an MPS server hands the clients of each of its GPUs in all.
#: Measured on an H100, driver 580 (issue 40, docs/benchmarks.md): clients x queues of 126 started (42x3, 21x6, 18x7,
#: 9x14), 128 did not (16x8, 32x4, 8x16, 4x32: a client died at cudaSetDevice with cudaErrorMemoryAllocation). The
#: budget is each GPU's, not the server's: one server over two GPUs took 14 clients x 16 (7 on each GPU) and refused
#: 15 (8 on one). Other cards and drivers are not measured; a caller's own CUDA_DEVICE_MAX_CONNECTIONS is kept.
GPU_CONNECTIONS = 126
#: What CUDA gives a process outside MPS, and the most mpsrun plans for a rank (an MPS client gets 2 by default).
PLAIN_CONNECTIONS = 8


class DaemonDefaults(NamedTuple):
    """What a session's daemons apply to clients that set no limit of their own: a thread cap, and a pinned
    memory limit per GPU position (one per daemon; under ``gpu_bind="none"`` the one daemon's is the first)."""

    thread_percentage: int | None = None
    mem_limits: tuple[int | None, ...] = ()  # MiB


def auto_mem_limit(free_bytes: int, ranks: int, where: str = "GPU 0", setting: str = "--mem-limit") -> int:
    """A GPU's free memory, less the server's share, split among its ``ranks``, in MiB.

    A rank's limit counts its own CUDA context (measured on an H100: a CuPy rank that filled a
    4G limit used 4036 MiB in all by NVML), so the limits add up to the free memory.
    """
    mib = (free_bytes // (1 << 20) - SERVER_SHARE_MIB) // max(1, ranks)
    if mib < _SMALLEST_AUTO_MIB:
        raise ConfigError(
            f"{setting} auto: {ranks} rank(s) on {where} would get {max(mib, 0)} MiB each of "
            f"{free_bytes >> 20} MiB free, too little for a CUDA context; use fewer ranks per GPU or more GPUs",
            setting=setting, value="auto")
    return mib


def auto_mem_limits(free: Sequence[int], sharing: Sequence[int], shared: bool,
                    setting: str = "--mem-limit") -> list[int | None]:
    """``auto`` for each GPU: its ``free`` bytes split among the ranks ``sharing`` it (None for a GPU without
    ranks). ``shared``: one daemon serves every GPU with one limit for each device, so the tightest GPU and the
    most crowded decide."""
    if shared:
        return [auto_mem_limit(min(free), max(sharing), "each GPU", setting)] * len(free)
    return [auto_mem_limit(bytes_, ranks, f"GPU {position}", setting) if ranks else None
            for position, (bytes_, ranks) in enumerate(zip(free, sharing, strict=True))]


def client_connections(clients: int) -> int:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` for each of a GPU's ``clients`` under one MPS server: as many as a plain process
    has, within the GPU's budget. With MPS's default of 2, a program's kernels on more than two streams run one after
    another (a 32-stream program took three times as long as alone, in every client)."""
    return max(1, min(PLAIN_CONNECTIONS, GPU_CONNECTIONS // max(1, clients)))


def memory_hint(gpu_index: int, free: int, total: int, sharers: int) -> str:
    """What to say of a rank that failed on a GPU it shared with ``sharers - 1`` others, none of them limited, when
    it had less than a rank's share of memory left (``free`` bytes, looked at as it ended): the others held more
    than theirs, which is what a limit per rank prevents. Empty otherwise (a rank's own exit code says no more)."""
    share = total // sharers
    if free >= share:
        return ""
    gib = 1 << 30
    return (f"GPU {gpu_index} had {free / gib:.1f} GiB free, less than one rank's share ({share / gib:.1f} GiB) with "
            f"{sharers} ranks and no memory limit; if it ran out of device memory, --mem-limit auto gives each rank "
            "its share")


def stored_mem_limit(mib: int) -> int:
    """A limit as the MPS daemon stores it as a default, in MiB: whole gigabytes from 1G up (measured on an
    H100: ``set_default_device_pinned_mem_limit 0 19981M`` read back as ``19G``), megabytes below.
    A client's own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` keeps megabytes (``0=1536M``: 1476 MiB used)."""
    return mib // 1024 * 1024 if mib >= 1024 else mib
