"""Validation of the MPS limits a user can ask for, and the client variables they become.

Pure functions, no I/O. Each value is validated once, where it enters (the command line,
an ``MPSRUN_*`` variable or an ``mps_session()`` argument); the typed result travels on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mpsrun.errors import ConfigError

__all__ = [
    "GPU_BINDS",
    "MPS_MODES",
    "SERVER_SHARE_MIB",
    "ThreadSpec",
    "auto_mem_limit",
    "client_variables",
    "parse_count",
    "parse_flag",
    "parse_gpu_bind",
    "parse_gpu_request",
    "parse_mem_limit",
    "parse_mps_mode",
    "parse_priority",
    "parse_seconds",
    "parse_thread_percentage",
    "parse_thread_spec",
    "session_mem_limits",
    "stored_mem_limit",
]

MPS_MODES = ("auto", "on", "off")
#: ``single``: each rank sees one GPU (its own daemon's); ``none``: every rank sees all the job's GPUs.
GPU_BINDS = ("single", "none")
#: Device memory the MPS server takes (66 MiB measured on an H100), with room to spare.
SERVER_SHARE_MIB = 128
#: Below this a rank's CUDA context alone would not fit.
_SMALLEST_AUTO_MIB = 1024
#: ``None`` (no cap), one percentage for every rank, ``"auto"``, or one per rank.
ThreadSpec = None | int | str | tuple[int, ...]
_MEM = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_SCALE_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}
_MAX_MIB = 1 << 30  # 1024 TiB: anything larger is a typo, not a limit


def _whole(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def parse_thread_percentage(value: object, setting: str = "thread_percentage") -> int:
    """An active-thread percentage: a whole number from 1 to 100."""
    number = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str):
        number = _whole(value)
    if number is None or not 1 <= number <= 100:
        raise ConfigError(
            f"{setting} must be a whole number from 1 to 100 (percent of the GPU's SMs), not {value!r}",
            setting=setting,
            value=value,
        )
    return number


def parse_thread_spec(value: object, setting: str = "--thread-percentage") -> ThreadSpec:
    """``auto``, ``P`` or ``P0,P1,...`` (one per rank), as text or as Python values."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and "," in value:
        return tuple(parse_thread_percentage(part, setting=setting) for part in value.split(","))
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{setting} lists no value", setting=setting, value=value)
        return tuple(parse_thread_percentage(part, setting=setting) for part in value)
    return parse_thread_percentage(value, setting=setting)


def parse_mem_limit(value: object, setting: str = "mem_limit") -> str:
    """A pinned device-memory limit in the form MPS takes (``"4G"``, ``"1536M"``), or ``"auto"``.

    Accepts ``4G``, ``4GiB``, ``512M``, ``1.5G`` or a number of bytes; MPS wants whole
    megabytes or gigabytes, so fractions are converted to megabytes. ``auto`` is resolved
    per GPU by :func:`auto_mem_limit` once the GPU's free memory and ranks are known.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    match = _MEM.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(
            f"{setting} must be a size such as 4G, 512M or 1.5G, not {value!r}", setting=setting, value=value
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    mib = number * _SCALE_MIB[unit]
    if not 1 <= mib <= _MAX_MIB:
        raise ConfigError(f"{setting} must be between 1M and 1024T, not {value!r}", setting=setting, value=value)
    if unit in ("G", "T") and (number * (1024 if unit == "T" else 1)).is_integer():
        return f"{int(mib // 1024)}G"
    return f"{int(mib)}M"


def parse_priority(value: object, setting: str = "priority") -> int:
    """An MPS client priority: 0 (normal) or 1 (below normal)."""
    if isinstance(value, bool) or str(value).strip() not in ("0", "1"):
        raise ConfigError(
            f"{setting} must be 0 (normal) or 1 (below normal), not {value!r}", setting=setting, value=value
        )
    return int(str(value).strip())


def _choice(value: object, choices: Sequence[str], setting: str) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or text not in choices:
        raise ConfigError(f"{setting} must be one of {', '.join(choices)}, not {value!r}", setting=setting, value=value)
    return text


def parse_mps_mode(value: object, setting: str = "mps") -> str:
    """``auto`` (MPS when possible), ``on`` (MPS or fail) or ``off``."""
    return _choice(value, MPS_MODES, setting)


def auto_mem_limit(free_bytes: int, ranks: int, where: str = "GPU 0", setting: str = "--mem-limit") -> str:
    """``--mem-limit auto``: a GPU's free memory, less the server's share, split among its ``ranks``.

    A rank's limit counts its own CUDA context (measured on an H100: a CuPy rank that filled a
    4G limit used 4036 MiB in all by NVML), so the limits add up to the free memory.
    """
    mib = (free_bytes // (1 << 20) - SERVER_SHARE_MIB) // max(1, ranks)
    if mib < _SMALLEST_AUTO_MIB:
        raise ConfigError(
            f"{setting} auto: {ranks} rank(s) on {where} would get {max(mib, 0)} MiB each of "
            f"{free_bytes >> 20} MiB free, too little for a CUDA context; use fewer ranks per GPU or more GPUs",
            setting=setting, value="auto")
    return f"{mib}M"


def stored_mem_limit(limit: str) -> str:
    """A limit as the MPS daemon stores it as a default: whole gigabytes from 1G up (measured on an
    H100: ``set_default_device_pinned_mem_limit 0 19981M`` read back as ``19G``), megabytes below.
    A client's own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` keeps megabytes (``0=1536M``: 1476 MiB used)."""
    if limit.endswith("M") and int(limit[:-1]) >= 1024:
        return f"{int(limit[:-1]) // 1024}G"
    return limit


def parse_count(value: object, setting: str) -> int:
    """A positive whole number (of workers, of ranks)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{setting} must be a positive whole number, not {value!r}", setting=setting, value=value)
    return value


def parse_gpu_bind(value: object, setting: str = "gpu_bind") -> str:
    """``single`` (one GPU per rank) or ``none`` (every rank sees all the job's GPUs through one daemon)."""
    return _choice(value, GPU_BINDS, setting)


def session_mem_limits(mem_limit: str | None, free: Sequence[int], workers: int | None,
                       shared: bool) -> list[str | None]:
    """A session's pinned memory limit per GPU; ``auto`` splits each GPU's ``free`` bytes among the ``workers``
    spread evenly over the GPUs (``shared``: one daemon serves them all, so the tightest GPU decides)."""
    if mem_limit != "auto":
        return [mem_limit] * len(free)
    if not free or workers is None:
        return [None] * len(free)
    sharing = -(-workers // len(free))
    if shared:
        return [auto_mem_limit(min(free), sharing, "each GPU", "mem_limit")] * len(free)
    return [auto_mem_limit(each, sharing, f"GPU {position}", "mem_limit") for position, each in enumerate(free)]


def client_variables(thread_percentage: int | None, mem_limit: str | None, priority: int | None,
                     devices: int = 1) -> dict[str, str]:
    """The MPS client variables for these (validated) limits; unset limits are left out.

    The memory limit applies to each of the client's ``devices`` (one, unless ranks see every GPU).
    """
    env: dict[str, str] = {}
    if thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    if mem_limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{d}={mem_limit}" for d in range(devices))
    if priority is not None:
        env["CUDA_MPS_CLIENT_PRIORITY"] = str(priority)
    return env


def parse_gpu_request(gpu: int | str | None, gpus: Sequence[int | str] | str | None) -> list[int | str] | None:
    """``mps_session(gpu=...)`` or ``gpus=...`` as a list of indices or UUIDs (None: every visible GPU)."""
    if gpu is not None and gpus is not None:
        raise ConfigError("give gpu= or gpus=, not both", setting="gpus", value=(gpu, gpus))
    if isinstance(gpus, str) and gpus.strip().lower() == "all":
        return None
    if isinstance(gpus, str):
        chosen: list[int | str] = [part.strip() for part in gpus.split(",") if part.strip()]
    elif gpus is not None:
        chosen = list(gpus) if isinstance(gpus, (list, tuple)) else [gpus]  # type: ignore[list-item]
    else:
        chosen = [0 if gpu is None else gpu]
    if not chosen:
        raise ConfigError(f"gpus= must name at least one GPU, not {gpus!r}", setting="gpus", value=gpus)
    for item in chosen:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ConfigError(f"a GPU is an index or a UUID string, not {item!r}", setting="gpus", value=item)
    return chosen


def parse_flag(value: object, setting: str) -> bool:
    """A true/false argument that must really be one (``"no"`` is not false-y enough to guess)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{setting} must be True or False, not {value!r}", setting=setting, value=value)
    return value


def parse_seconds(value: object, setting: str) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ConfigError(f"{setting} must be a positive number of seconds, not {value!r}", setting=setting)
    return float(value)
