"""Validation of the MPS limits a user can ask for. Pure functions, no I/O."""

from __future__ import annotations

import math
import re

from mpsrun.errors import ConfigError

__all__ = [
    "MPS_MODES",
    "client_variables",
    "parse_mem_limit",
    "parse_mps_mode",
    "parse_priority",
    "parse_thread_percentage",
]

MPS_MODES = ("auto", "on", "off")
_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_SCALE_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}


def parse_thread_percentage(value: object, setting: str = "thread_percentage") -> int:
    """An active-thread percentage: an integer from 1 to 100."""
    if isinstance(value, bool):
        raise ConfigError(f"{setting} must be an integer from 1 to 100, not {value!r}", setting=setting, value=value)
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not number.is_integer() or not 1 <= number <= 100:
        raise ConfigError(
            f"{setting} must be an integer from 1 to 100 (percent of the GPU's SMs), not {value!r}",
            setting=setting,
            value=value,
        )
    return int(number)


def parse_mem_limit(value: object, setting: str = "mem_limit") -> str:
    """A pinned device-memory limit in the form MPS takes (``"4G"``, ``"1536M"``).

    Accepts ``4G``, ``4GiB``, ``512M``, ``1.5G`` or a number of bytes; MPS wants whole
    megabytes or gigabytes, so fractions are converted to megabytes.
    """
    if isinstance(value, bool):
        match = None
    elif isinstance(value, int):
        match = _MEM.match(str(value))
    else:
        match = _MEM.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(
            f"{setting} must be a size such as 4G, 512M or 1.5G, not {value!r}", setting=setting, value=value
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    mib = number * _SCALE_MIB[unit]
    if mib < 1:
        raise ConfigError(f"{setting} must be at least 1M, not {value!r}", setting=setting, value=value)
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


def parse_mps_mode(value: object, setting: str = "mps") -> str:
    """``auto`` (MPS when possible), ``on`` (MPS or fail) or ``off``."""
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in MPS_MODES:
        raise ConfigError(f"{setting} must be one of auto, on, off, not {value!r}", setting=setting, value=value)
    return text


def client_variables(thread_percentage: int | None, mem_limit: str | None, priority: int | None) -> dict[str, str]:
    """The MPS client variables for these (validated) limits; unset limits are left out.

    The memory limit names device 0: mpsrun gives every client exactly one GPU.
    """
    env: dict[str, str] = {}
    if thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    if mem_limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mem_limit}"
    if priority is not None:
        env["CUDA_MPS_CLIENT_PRIORITY"] = str(priority)
    return env
