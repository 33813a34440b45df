"""Every value a user can give mpsrun, validated here and nowhere else.

Pure functions, no I/O but for reading a host file. Each takes text (the command line, an
``MPSRUN_*`` variable) or a Python value (an ``mps_session()`` argument), returns the typed value
that travels on to the ranks, and raises :class:`~mpsrun.errors.ConfigError` (exit 2) naming the
setting for anything else.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence

from mpsrun.errors import ConfigError
from mpsrun.runtime.constants import MOST_QUEUES
from mpsrun.runtime.files import read_file
from mpsrun.runtime.output import clipped, printable

__all__ = [
    "AUTO",
    "GPU_BINDS",
    "LAUNCHERS",
    "LOCAL_RANKS",
    "MAP_POLICIES",
    "MAX_RANKS",
    "MOST_QUEUES",
    "MPS_MODES",
    "Auto",
    "GpuList",
    "MemLimit",
    "Queues",
    "ThreadSpec",
    "check_shares",
    "host_names",
    "hostfile_lines",
    "mib_text",
    "parse_choice",
    "parse_count",
    "parse_export",
    "parse_flag",
    "parse_gpu_arguments",
    "parse_gpus",
    "parse_hostfile",
    "parse_hosts",
    "parse_mem_limit",
    "parse_output_dir",
    "parse_priority",
    "parse_queues",
    "parse_ranks",
    "parse_report",
    "parse_seconds",
    "parse_thread_percentage",
    "parse_thread_spec",
    "resolve_exports",
]

MPS_MODES = ("auto", "on", "off")
#: ``single``: each rank sees one GPU (its own daemon's); ``none``: every rank sees all the job's GPUs.
GPU_BINDS = ("single", "none")
LAUNCHERS = ("auto", "local", "mpiexec")
MAP_POLICIES = ("block", "round-robin")
LOCAL_RANKS = ("node", "device")
MAX_RANKS = 1 << 20
#: The largest host file read (16 MiB: a line for each of tens of thousands of hosts, comments and all).
HOSTFILE_LIMIT = 1 << 24


class Auto(str, enum.Enum):
    """``auto``: a value each node works out once its GPUs and ranks are known. Equal to the text ``"auto"`` (a
    configuration that went through JSON compares the same)."""

    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


AUTO = Auto.AUTO
#: ``None`` (no cap), one percentage for every rank, ``AUTO``, or one per rank.
ThreadSpec = None | int | Auto | tuple[int, ...]
#: ``None`` (no limit), a pinned device-memory limit in MiB, or ``AUTO``.
MemLimit = None | int | Auto
#: ``None`` (MPS's default for its clients), hardware work queues for each MPS rank, or ``AUTO`` (planned per GPU).
Queues = None | int | Auto
#: GPUs by position among the visible ones, or by ``GPU-`` UUID (or a prefix of one); None: every visible GPU.
GpuList = tuple[int | str, ...] | None
_MEM = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_SCALE_MIB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}
_MAX_MIB = 1 << 30  # 1024 TiB: anything larger is a typo, not a limit
#: A host as MPI launchers take it: a name or address, optionally ``:N`` slots (never an option, never a space).
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(:[0-9]+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What mpsrun sets in every rank itself (README, "The command"): not the caller's to pass with -x.
_SET_BY_MPSRUN = re.compile(r"(MPSRUN_|CUDA_MPS_).*|CUDA_VISIBLE_DEVICES|(LOCAL_|GROUP_|ROLE_)?(RANK|WORLD_SIZE)")
_HOST_LINE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(:[0-9]+)?([ \t]+(slots|max_slots|max-slots)=[0-9]+)*")


def _whole(value: object) -> int | None:
    """A whole number from an int (not a bool) or from ASCII digits; None otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.isascii() and text.isdigit() and len(text) <= 30:  # (more is no number any setting takes)
        return int(text)
    return None


def _shown(value: object) -> str:
    """A value as a message shows it: its repr, cut to a length a line can hold."""
    return clipped(repr(value), 60)


def parse_choice(value: object, choices: Sequence[str], setting: str) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or text not in choices:
        raise ConfigError(f"{setting} must be one of {', '.join(choices)}, not {_shown(value)}", setting=setting,
                          value=value)
    return text


def _bounded(value: object, low: int, high: int, setting: str, unit: str = "") -> int:
    """A whole number from ``low`` to ``high`` (an int, or ASCII digits: ``1e2`` is refused)."""
    number = _whole(value)
    if number is None or not low <= number <= high:
        raise ConfigError(f"{setting} must be a whole number from {low} to {high}{unit}, not {_shown(value)}",
                          setting=setting, value=value)
    return number


def parse_ranks(value: object, setting: str = "-np") -> int:
    """A number of ranks: 1 to MAX_RANKS."""
    return _bounded(value, 1, MAX_RANKS, setting)


#: A farm's most retries of one task, and most tasks (each is a process; a typo in a range is refused).
MAX_RETRIES, MAX_TASKS = 1000, 10_000_000
_INDEX_RANGE = re.compile(r"([0-9]{1,30})-([0-9]{1,30})(?::([0-9]{1,30}))?|([0-9]{1,30})")  # (ASCII digits only)


def parse_retries(value: object, setting: str = "--retries") -> int:
    """How many more times a failed task runs: 0 to MAX_RETRIES."""
    return _bounded(value, 0, MAX_RETRIES, setting)


def parse_index_range(value: object, setting: str = "--array") -> range:
    """``A-B[:STEP]`` (or one index ``A``): the indices A, A+STEP, ... up to B included."""
    match = _INDEX_RANGE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{setting} takes A-B or A-B:STEP (whole numbers), not {_shown(value)}", setting=setting,
                          value=value)
    first, last, step, single = match.groups()
    if single is not None:
        return range(int(single), int(single) + 1)
    indices = range(int(first), int(last) + 1, max(1, int(step or 1)))
    if int(step or 1) < 1 or not indices:
        raise ConfigError(f"{setting} {value}: no index (the range must not be empty and its step at least 1)",
                          setting=setting, value=value)
    if (indices[-1] - indices[0]) // indices.step >= MAX_TASKS:  # (len() of a range past 2**63 overflows)
        raise ConfigError(f"{setting} {value}: more than {MAX_TASKS} tasks", setting=setting, value=value)
    return indices


def parse_index_range_text(value: object, setting: str = "--array") -> str:
    """``--array``'s text, once :func:`parse_index_range` reads it (kept as text: a configuration goes as JSON)."""
    parse_index_range(value, setting)
    assert isinstance(value, str)
    return value.strip()


def parse_task_file(value: object, setting: str = "--tasks") -> str:
    """A task file (``-``: standard input), made absolute here."""
    text = value if isinstance(value, str) else ""
    if not text.strip() or "\0" in text:
        raise ConfigError(f"{setting} needs a file (or - for standard input), not {value!r}", setting=setting,
                          value=value)
    return text if text == "-" else absolute(text, setting, value)


def absolute(text: str, setting: str, value: object) -> str:
    """The path ``text`` made absolute; a ConfigError where it is relative and the working directory was removed
    (``os.getcwd`` fails: that said only 'No such file or directory')."""
    try:
        return os.path.abspath(text)
    except FileNotFoundError:
        gone = os.environ.get("PWD")  # the shell's word for it, where it is gone too (a stale one names another)
        where = f" ({printable(gone)})" if gone and not os.path.lexists(gone) else ""
        raise ConfigError(f"{setting} {printable(text)}: a relative path, but the working directory{where} was "
                          "removed", setting=setting, value=value) from None


def parse_count(value: object, setting: str) -> int:
    """A positive whole number (of workers, of repeats), as an int or its ASCII digits."""
    number = _whole(value)
    if number is None or number < 1:
        raise ConfigError(f"{setting} must be a positive whole number, not {_shown(value)}", setting=setting,
                          value=value)
    return number


#: Longer waits than 31 years are a typo, and some of the system's timers overflow on them.
MAX_SECONDS = 1e9


def parse_seconds(value: object, setting: str, allow_zero: bool = False) -> float:
    """A finite number of seconds, positive (or zero when allowed), from a number or its text."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and value.isascii() and "_" not in value:  # float() takes other scripts' digits,
        with contextlib.suppress(ValueError):  # and 1_0 as 10
            number = float(value)
    if not (0 <= number < MAX_SECONDS if allow_zero else 0 < number < MAX_SECONDS):
        least = "0 or more" if allow_zero else "more than 0"
        raise ConfigError(f"{setting} must be {least} seconds (and below {MAX_SECONDS:,.0f}), not {value!r}",
                          setting=setting, value=value)
    return number


def parse_flag(value: object, setting: str) -> bool:
    """A true/false argument that must really be one (``"no"`` is not false-y enough to guess)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{setting} must be True or False, not {value!r}", setting=setting, value=value)
    return value


def parse_thread_percentage(value: object, setting: str = "thread_percentage") -> int:
    """An active-thread percentage: a whole number from 1 to 100."""
    return _bounded(value, 1, 100, setting, " (percent of the GPU's SMs)")


def parse_thread_spec(value: object, setting: str = "--thread-percentage") -> ThreadSpec:
    """``auto``, ``P`` or ``P0,P1,...`` (one per rank), as text or as Python values."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    parts = value.split(",") if isinstance(value, str) and "," in value else value
    if isinstance(parts, (list, tuple)):
        if not parts:
            raise ConfigError(f"{setting} lists no value", setting=setting, value=value)
        return tuple(parse_thread_percentage(part, setting=setting) for part in parts)
    return parse_thread_percentage(value, setting=setting)


def check_shares(spec: ThreadSpec, ranks: int | None, setting: str = "--thread-percentage", what: str = "rank") -> None:
    """A --thread-percentage list gives one value per rank of the job (``ranks``, when known; ``what``: an
    executor's workers)."""
    if isinstance(spec, tuple) and ranks is not None and len(spec) != ranks:
        raise ConfigError(f"{setting} lists {len(spec)} values but there are {ranks} {what}s; give one value per "
                          f"{what}, a single value, or auto", setting=setting, value=spec)


def parse_mem_limit(value: object, setting: str = "mem_limit") -> int | Auto:
    """A pinned device-memory limit in whole MiB (MPS takes whole megabytes or gigabytes), or ``AUTO``.

    Accepts ``4G``, ``4GiB``, ``512M``, ``1.5G`` or a number of bytes. ``auto`` is resolved
    per GPU (:mod:`mpsrun.mps.limits`) once the GPU's free memory and ranks are known.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    match = _MEM.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"{setting} must be a size such as 4G, 512M or 1.5G, not {value!r}", setting=setting,
                          value=value)
    number, unit = float(match.group(1)), match.group(2).upper()
    mib = number * _SCALE_MIB[unit]
    if not 1 <= mib <= _MAX_MIB:
        raise ConfigError(f"{setting} must be between 1M and 1024T, not {value!r}", setting=setting, value=value)
    return int(mib)


def mib_text(mib: int) -> str:
    """A limit as MPS spells it: whole gigabytes as ``4G``, else megabytes (``1536M``)."""
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def mem_limit_text(limit: int | Auto) -> str:
    """``--mem-limit``'s value as given on a command line."""
    return str(limit) if limit == AUTO else mib_text(int(limit))


def parse_queues(value: object, setting: str = "--queues") -> int | Auto:
    """Hardware work queues per MPS rank (``CUDA_DEVICE_MAX_CONNECTIONS``, 1 to 32), or ``AUTO``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    return _bounded(value, 1, MOST_QUEUES, setting, " (CUDA's hardware queues) or auto")


def parse_priority(value: object, setting: str = "priority") -> int:
    """An MPS client priority: 0 (normal) or 1 (below normal)."""
    if isinstance(value, bool) or str(value).strip() not in ("0", "1"):
        raise ConfigError(f"{setting} must be 0 (normal) or 1 (below normal), not {value!r}", setting=setting,
                          value=value)
    return int(str(value).strip())


def _gpu(item: object, whole: object, setting: str) -> int | str:
    number = _whole(item)
    if number is not None and number >= 0:
        return number
    if isinstance(item, str) and item.strip().startswith("GPU-") and len(item.strip()) > 4:
        return item.strip()
    raise ConfigError(f"{setting} must be all or a comma-separated list of GPU indices or GPU- UUIDs, not {whole!r}",
                      setting=setting, value=whole)


def parse_gpus(value: object, setting: str = "--gpus") -> GpuList:
    """GPUs as ``all`` (None: every visible one), ``"0,1"``, ``"GPU-5ecd,1"``, an int, or a list of them."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if isinstance(value, str):
        items: list[object] = [*value.split(",")] if value.replace(",", "").strip() else []
    else:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError(f"{setting} must name at least one GPU, not {value!r}", setting=setting, value=value)
    chosen = tuple(_gpu(item, value, setting) for item in items)
    twice = sorted({str(g) for g in chosen if chosen.count(g) > 1})
    if twice:
        raise ConfigError(f"{setting}: GPU {', '.join(twice)} is listed twice", setting=setting, value=value)
    return chosen


def parse_gpu_arguments(gpu: object, gpus: object) -> GpuList:
    """``mps_session(gpu=...)`` or ``gpus=...`` as one GPU list (default: GPU 0)."""
    if gpu is not None and gpus is not None:
        raise ConfigError("give gpu= or gpus=, not both", setting="gpus", value=(gpu, gpus))
    if gpus is not None:
        return parse_gpus(gpus, "gpus")
    return parse_gpus([0 if gpu is None else gpu], "gpu")


def parse_hosts(value: object, setting: str = "--hosts") -> tuple[str, ...]:
    """Hosts as ``a,b:2``: each a host name or address, as host-file lines name them (never an option)."""
    text = value if isinstance(value, str) else ""
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise ConfigError(f"{setting} must name at least one host, not {value!r}", setting=setting, value=value)
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise ConfigError(f"{setting} must name hosts (letters, digits, '.', '-' and '_', optionally :N; never "
                              f"an option), not {host!r}", setting=setting, value=value)
        _check_host(host, setting, value)
    return hosts


#: A host name's length (DNS: 253 characters in all, 63 between dots) and the slots one host may have.
_HOST_NAME_MOST, _LABEL_MOST = 253, 63


def _check_host(entry: str, setting: str, value: object, where: str = "") -> None:
    """A host entry's name fits DNS's lengths, and each slot count in it (``:N``, ``slots=N``) is 1 to MAX_RANKS."""
    name = entry.split()[0].split(":")[0]
    if len(name) > _HOST_NAME_MOST or any(len(label) > _LABEL_MOST for label in name.split(".")):
        raise ConfigError(f"{setting}{where}: host name {name[:40]!r}... is longer than a host name can be "
                          f"({_HOST_NAME_MOST} characters, {_LABEL_MOST} between dots)", setting=setting, value=value)
    for count in re.findall(r"(?::|=)([0-9]+)", entry):
        if not 1 <= int(count) <= MAX_RANKS:
            raise ConfigError(f"{setting}{where}: {entry!r} gives a host {count} slots; a host has 1 to "
                              f"{MAX_RANKS:,}", setting=setting, value=value)


def hostfile_lines(path: str, setting: str = "--hostfile") -> list[str]:
    """The host lines of a host file (comments and blank lines left out)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):  # a pipe is read once, and mpsrun reads the file more than once
            raise ConfigError(f"host file {path!r} is a pipe, which can be read only once; give a file",
                              setting=setting, value=path)
        if not stat.S_ISREG(mode):  # a device: /dev/zero never ends
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"host file {path!r} is {what}; give a file", setting=setting, value=path)
        lines = [line.split("#", 1)[0].strip() for line in read_file(path, HOSTFILE_LIMIT, follow=True).decode()
                 .splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read host file {path!r}: {getattr(exc, 'strerror', None) or exc}",
                          setting=setting, value=path) from None
    return [line for line in lines if line]


def host_names(hosts: Sequence[str], hostfile: str | None) -> list[str]:
    """The host names of ``--hosts`` (``a,b:2``) or of a host file's lines (``a``, ``a:2``, ``a slots=2``)."""
    lines = hosts or (hostfile_lines(hostfile) if hostfile else [])
    return [re.split(r"[:\s]", line, maxsplit=1)[0] for line in lines]


def parse_hostfile(value: object, setting: str = "--hostfile") -> str:
    """A host file: a readable file naming at least one host (``host``, ``host:N`` or ``host slots=N`` lines)."""
    path = str(value)
    hosts = hostfile_lines(path, setting)
    if not hosts:
        raise ConfigError(f"host file {path!r} names no host", setting=setting, value=path)
    for line in hosts:
        if not _HOST_LINE.fullmatch(line):
            raise ConfigError(f"host file {path!r}: {line!r} is not a host line (host, host:N or host slots=N)",
                              setting=setting, value=path)
        _check_host(line, setting, path, f" {path!r}")
    return path


def parse_export(value: object, setting: str = "-x") -> str:
    """``NAME`` (the caller's value) or ``NAME=VALUE``, as ``mpirun -x`` takes it; never a variable mpsrun sets."""
    text = value if isinstance(value, str) else ""
    name = text.split("=", 1)[0]
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{setting} takes NAME or NAME=VALUE (a variable name: letters, digits, _), not {value!r}",
                          setting=setting, value=value)
    if _SET_BY_MPSRUN.fullmatch(name):
        raise ConfigError(f"{setting} {name}: mpsrun sets {name} in each rank itself", setting=setting, value=value)
    return text


def resolve_exports(items: Sequence[str], environ: Mapping[str, str]) -> tuple[str, ...]:
    """``-x`` values with the caller's values filled in, where the command line is read: ``NAME=VALUE``, or
    ``NAME`` alone for one the caller has not set (the ranks then have it unset too)."""
    return tuple(item if "=" in item or item not in environ else f"{item}={environ[item]}" for item in items)


def parse_output_dir(value: object, setting: str = "--output-filename") -> str:
    """A directory for the ranks' output files, made absolute here (a remote host's ranks start elsewhere)."""
    text = value if isinstance(value, str) else ""
    if not text.strip() or "\0" in text:
        raise ConfigError(f"{setting} needs a directory, not {value!r}", setting=setting, value=value)
    return absolute(text, setting, value)


def parse_report(value: object, setting: str = "--report") -> str:
    """A file for the job's report, made absolute here: a FIFO or a device (written into as it stands), or a file in
    a directory this user can write now (a job that ran for hours should not end unable to write it)."""
    text = value if isinstance(value, str) else ""
    if not text.strip() or "\0" in text:
        raise ConfigError(f"{setting} needs a file name, not {value!r}", setting=setting, value=value)
    path = absolute(text, setting, value)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        return path
    directory = os.path.dirname(os.path.realpath(path))  # through a symlink, its target's
    if os.path.isdir(path) or not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting} {printable(text)}: not a file in a directory this user can write",
                          setting=setting, value=value)
    return path


def parse_module(value: object, setting: str = "-m") -> str:
    """A module name as ``python -m`` takes it: names joined by dots."""
    text = value if isinstance(value, str) else ""
    if not all(part.isidentifier() for part in text.split(".")):
        raise ConfigError(f"{setting} needs a Python module name (as python -m takes it), not {value!r}",
                          setting=setting, value=value)
    return text
