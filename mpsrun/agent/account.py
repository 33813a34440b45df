"""Each rank's account at the job's end: where it ran, its peak device memory, its time, how it ended.

The agent of a rank's node tells the rank's end with its account (:class:`~mpsrun.runtime.protocol.Ended`, in the same
process or from each host under ``--hosts``), so whoever decides the job holds every rank's. ``-v`` prints them as a
table, ``--report FILE`` writes them as JSON (with the memory samples), and :func:`memory_hint` names ranks whose peak
and memory limit are far apart.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from mpsrun.agent.outcome import ranges
from mpsrun.config.values import mib_text
from mpsrun.mps.usage import Sample, UsageSampler
from mpsrun.runtime.files import replace_file, write_into
from mpsrun.runtime.output import printable
from mpsrun.runtime.protocol import Ended

if TYPE_CHECKING:
    from mpsrun.config.options import JobConfig

__all__ = ["NEAR_LIMIT", "RankAccount", "Report", "account_lines", "accounted", "cell", "memory_hint", "report_path",
           "to_say"]

#: A peak within this fraction of the rank's memory limit is near it; one below a quarter of it leaves most unused.
NEAR_LIMIT, MOSTLY_UNUSED = 0.9, 0.25
#: A suggested limit: the largest peak with this much room, rounded up to this many MiB.
ROOM, ROUND_MIB = 1.25, 256


class RankAccount(NamedTuple):
    """One rank's account. ``gpu``: its GPU's index on its host (None: it saw every GPU of its session, or none);
    ``mps``: proven an MPS client (None: not known, without MPS or on another host); memory in MiB (``memory_peak``
    None: never sampled, a rank that ended before the first look or a GPU NVML does not count); ``memory_share``:
    its part of its GPU's memory when it shared the GPU with no limit; times in seconds; ``exit_code`` None: lost."""

    rank: int
    host: str
    pid: int | None
    gpu: int | None
    mps: bool | None
    memory_peak: int | None
    memory_limit: int | None
    memory_share: int | None
    thread_percentage: int | None
    wall: float | None
    cpu: float | None
    exit_code: int | None
    cause: str

    @classmethod
    def of(cls, ended: Ended, cause: str) -> RankAccount:
        """A rank's account from its end as its agent told it, and the ``cause`` the job's decision gives it."""
        return cls(ended.rank, ended.host, ended.pid, ended.gpu, ended.mps, ended.memory_peak, ended.memory_limit,
                   ended.memory_share, ended.thread_percentage, ended.wall, ended.cpu, ended.returncode, cause)


def cell(value: object, unit: str = "") -> str:
    """A table's cell: "-" for what is not known, yes/no, seconds to the hundredth."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


HEADER = ("rank", "host", "pid", "gpu", "mps", "peak MiB", "limit", "SM %", "wall s", "cpu s", "exit", "cause")


def account_lines(accounts: Sequence[RankAccount]) -> list[str]:
    """The accounts as a table, one line a rank, for ``-v``."""
    rows = [HEADER] + [(str(a.rank), a.host, cell(a.pid), cell(a.gpu), cell(a.mps), cell(a.memory_peak),
                        mib_text(a.memory_limit) if a.memory_limit else "-", cell(a.thread_percentage),
                        cell(a.wall), cell(a.cpu), cell(a.exit_code), a.cause) for a in accounts]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]  # the cause, last, runs on
    return ["  ".join(text.ljust(width) if i == 1 else text.rjust(width)  # the host's name to the left
                      for i, (text, width) in enumerate(zip(row, widths, strict=False))) + "  " + row[-1]
            for row in rows]


def _suggested(peak: int) -> str:
    return mib_text(-(-int(peak * ROOM) // ROUND_MIB) * ROUND_MIB)


def memory_hint(accounts: Iterable[RankAccount]) -> str:
    """One line on memory limits, from the ranks' peaks, or "": ranks that peaked near their ``--mem-limit`` (the next
    allocation may fail), else ranks that all used under a quarter of theirs (the rest could go to others), else
    ranks without a limit that peaked above their share of a shared GPU (``--mem-limit auto`` would fail them)."""
    measured = [(a, a.memory_peak) for a in accounts if a.memory_peak is not None]
    limited = [(a, peak, a.memory_limit) for a, peak in measured if a.memory_limit]
    near = [(a, peak, limit) for a, peak, limit in limited if peak >= NEAR_LIMIT * limit]
    if near:
        _, peak, limit = max(near, key=lambda item: item[1])
        return (f"rank(s) {ranges([a.rank for a, _, _ in near])} peaked within {100 - int(NEAR_LIMIT * 100)}% of "
                f"their --mem-limit (up to {peak} MiB of {mib_text(limit)}): an allocation beyond the limit fails; "
                f"--mem-limit {_suggested(peak)} would give them room")
    if limited and all(peak < MOSTLY_UNUSED * limit for _, peak, limit in limited):
        peak = max(peak for _, peak, _ in limited)
        return (f"rank(s) {ranges([a.rank for a, _, _ in limited])} used at most {peak} MiB of their --mem-limit "
                f"({mib_text(max(limit for _, _, limit in limited))}): --mem-limit {_suggested(peak)} would leave "
                "the rest of the GPU to others")
    over = [(a, peak, a.memory_share) for a, peak in measured
            if not a.memory_limit and a.memory_share and peak > a.memory_share]
    if over:
        return (f"rank(s) {ranges([a.rank for a, _, _ in over])} peaked above their share of their GPU's memory (up "
                f"to {max(peak for _, peak, _ in over)} MiB of {min(share or 0 for _, _, share in over)} MiB): "
                "--mem-limit auto would make their allocations fail")
    return ""


def accounted(config: JobConfig) -> bool:
    """Whether a job's end has accounts to say or write: with -v, --report or a --mem-limit (for the hint)."""
    return config.verbose or bool(config.report) or config.mem_limit is not None


def to_say(accounts: Sequence[RankAccount], config: JobConfig) -> tuple[list[str], list[str]]:
    """What a job's end says of its ranks' accounts: the table (with -v), and the memory hint (with a --mem-limit,
    or -v)."""
    table = account_lines(accounts) if config.verbose else []
    hint = memory_hint(accounts) if config.mem_limit is not None or config.verbose else ""
    return table, [f"hint: {hint}"] if hint else []


def report_path(path: str, per_host: bool) -> str:
    """Where a report goes: ``path``, or under a bare ``--per-node`` job (each node writes its own ranks')
    ``path`` with the host's name before its suffix (``job.json`` -> ``job.node01.json``). A FIFO or a device is
    written as it stands on every path (a file made beside it would be left there: ``/dev/full.node01``)."""
    if not per_host or _as_it_stands(path):
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{socket.gethostname()}{suffix}"


def _as_it_stands(path: str) -> bool:
    """Whether a report goes into ``path`` as it stands (through links: a FIFO or a device), not replacing it."""
    return os.path.exists(path) and not os.path.isfile(path)


def _version() -> str | None:
    """mpsrun's version as installed (the package's own import would reach above this layer)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("mpsrun")
    except importlib.metadata.PackageNotFoundError:
        return None


class Report(NamedTuple):
    """What ``--report FILE`` writes: the job's end, every rank's account, and the memory samples."""

    command: list[str]
    exit_code: int
    cause: str
    summary: str
    started: float
    ended: float
    sample_interval: float | None
    ranks: list[RankAccount]
    samples: list[Sample]

    @classmethod
    def of(cls, command: Sequence[str], ending: tuple[int, str, str], started: float, accounts: list[RankAccount],
           usage: UsageSampler | None, interval: float) -> Report:
        """The report of a job that ended as ``ending`` says (exit code, cause, summary), with ``usage``'s samples."""
        code, cause, summary = ending
        return cls(list(command), code, cause, summary, started, time.time(), interval if usage is not None else None,
                   accounts, usage.samples if usage is not None else [])

    def save(self, path: str) -> str:
        """Write the report to ``path``; what failed, in a line, if it could not be written."""
        try:
            self.write(path)
        except OSError as exc:
            return f"cannot write the report {printable(path)}: {exc.strerror or exc}"
        return ""

    def write(self, path: str) -> None:
        """Write the report as JSON to ``path``: through a symlink, to its target; into a FIFO or a device as it
        stands (a FIFO no one reads is an error, not a wait); a file whole or not at all (a new file beside it,
        renamed over it)."""
        data = {"mpsrun": _version(), **self._asdict(), "ranks": [account._asdict() for account in self.ranks]}
        data["samples"] = [{"time": s.time, "memory": {str(r): m for r, m in s.memory.items()}} for s in self.samples]
        text = json.dumps(data, indent=1) + "\n"
        if _as_it_stands(path):
            write_into(path, text.encode())
        else:
            replace_file(Path(os.path.realpath(path)), text.encode(), mode=0o666)  # as the user's other files are
