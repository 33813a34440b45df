"""One look of ``mpsrun top``: this user's running jobs on this node, a row per rank and per GPU, from the sessions'
records and ``usage.json``, the ranks' environments, psutil and NVML (:mod:`mpsrun.tools.top` shows it).

A look reads each shown rank's process and walks up from each GPU process to its rank; it never scans the machine's
whole process table, so its cost grows with the ranks shown, not with the machine's processes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import psutil

from mpsrun.errors import MPSError
from mpsrun.mps import gpus as gpu_info
from mpsrun.runtime.files import read_file
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import SessionDirs
from mpsrun.session.registry import SessionState, list_sessions

__all__ = ["CPU_WINDOW", "GpuRow", "JobRow", "RankRow", "Snapshot", "Top"]

#: Per GPU (by UUID): each process with a context there, its device memory (MiB) and whether it is an MPS client.
Contexts = dict[str, dict[int, tuple[int, bool]]]

#: The most of a session's usage.json that is read (a job of thousands of ranks writes well under this).
USAGE_READ_LIMIT = 1 << 22

#: The first look of a process's CPU use measures from this long before the snapshot (psutil needs two).
CPU_WINDOW = 0.5

#: The most digits of a number read from a rank's environment or usage.json (MAX_RANKS has seven).
_NUMBER_DIGITS = 7

#: How many generations up from a GPU process its rank is looked for (a rank's program, its children, theirs ...).
_MOST_GENERATIONS = 64


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank now. ``mps``: an MPS client (None: no CUDA context seen); memory in MiB (``memory``: device memory
    now, over the rank's processes; ``peak``: the most its job's controller or this view saw); ``limit``: its
    pinned-memory limit as MPS was given it; ``running``: seconds since it started. A rank on another host of a
    ``--hosts`` job, as its controller here heard of it, has its host, pid and peak only. A farm's slot (``rank``: the
    slot) shows the ``task`` it runs now."""

    job: str
    rank: int | None
    host: str
    pid: int
    gpu: int | None
    mps: bool | None
    memory: int | None
    peak: int | None
    limit: str | None
    threads: int | None
    cpu: float | None
    resident: int | None
    state: str
    running: float | None
    task: int | None = None


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU: its SM activity (percent, None where NVML cannot say), device memory used and total (MiB) and the
    MPS clients on it (of every user and program)."""

    index: int
    uuid: str
    sm: int | None
    used: int
    total: int
    clients: int


@dataclass(frozen=True, slots=True)
class JobRow:
    """One running job (or a node's part of one): its session, kind, owner, command and age in seconds."""

    session: str
    kind: str
    owner: int
    command: list[str]
    age: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One look (``time``: seconds since the epoch): the running jobs, their ranks, the GPUs."""

    time: float
    jobs: list[JobRow]
    ranks: list[RankRow]
    gpus: list[GpuRow]


class Top:
    """Looks at this user's jobs; keeps each process between looks (CPU use is measured from one look to the next)
    and the peaks it has seen. ``job``: one session's name or its owner's pid."""

    def __init__(self, base: Path | None = None, job: str | None = None) -> None:
        self.base, self.job = base, job
        self._processes: dict[tuple[int, int | None], psutil.Process] = {}
        self._peaks: dict[tuple[str, int], int] = {}

    def jobs(self) -> list[SessionState]:
        """The running jobs (their owner alive), or the one asked for."""
        return [s for s in list_sessions(self.base) if s.record is not None and s.record.kind in ("job", "node")
                and s.owner_alive and self.job in (None, s.session_id, str(s.record.owner.pid))]

    def prime(self) -> None:
        """Start each running rank's CPU measurement (psutil needs two looks at a process), without a snapshot: what
        ``--once`` does before its one snapshot."""
        for state in self.jobs():
            for ref in state.record.ranks if state.record is not None else ():
                self._process(ref)

    def snapshot(self) -> Snapshot:
        """One look. It reads each shown rank's process and each GPU process's parents, never the machine's whole
        process table: its cost grows with the ranks shown, not with the processes of the machine."""
        states = self.jobs()
        gpus = _gpus()
        contexts = _contexts(gpus)
        live = {state.session_id: [process for ref in state.record.ranks if (process := self._process(ref))]
                for state in states if state.record is not None}
        by_rank = _contexts_by_rank(contexts, {process.pid for processes in live.values() for process in processes})
        here = socket.gethostname()
        ranks = [row for state in states
                 for row in self._ranks(state, live.get(state.session_id, []), gpus, by_rank, here)]
        self._forget({(row.pid, row.job, row.rank) for row in ranks})
        jobs = [JobRow(s.session_id, s.record.kind, s.record.owner.pid, list(s.record.argv), round(s.age, 1))
                for s in states if s.record is not None]
        return Snapshot(round(time.time(), 3), jobs, sorted(ranks, key=_order), _gpu_rows(gpus, contexts))

    def _ranks(self, state: SessionState, processes: list[psutil.Process], gpus: list[gpu_info.GPU],
               by_rank: dict[int, list[tuple[int, bool]]], here: str) -> Iterator[RankRow]:
        published = _published(state.root)
        yield from (row for row in published.values() if row.host != here)
        peaks = {rank: row.peak for rank, row in published.items() if row.host == here and row.peak is not None}
        for process in processes:
            with contextlib.suppress(psutil.Error):
                yield self._row(state.session_id, process, gpus, by_rank.get(process.pid, []), peaks, here)

    def _forget(self, shown: set[tuple[int, str, int | None]]) -> None:
        """Drop what is kept of processes and ranks no longer shown (a live view runs for days)."""
        pids = {pid for pid, _, _ in shown}
        ranks = {(job, rank) for _, job, rank in shown}
        self._processes = {key: process for key, process in self._processes.items() if key[0] in pids}
        self._peaks = {key: peak for key, peak in self._peaks.items() if key in ranks}

    def _process(self, ref: ProcessRef) -> psutil.Process | None:
        """The live process the record names (a reused pid is another's)."""
        if not ref.alive():
            return None
        key = (ref.pid, ref.start)
        if key not in self._processes:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(ref.pid)
                process.cpu_percent()  # the first call starts the measurement
                self._processes[key] = process
        return self._processes.get(key)

    def _row(self, job: str, process: psutil.Process, gpus: list[gpu_info.GPU], seen: list[tuple[int, bool]],
             peaks: dict[int, int], here: str) -> RankRow:
        """``seen``: the CUDA contexts of the rank's process and its descendants (device memory in MiB, MPS)."""
        env = process.environ()
        task = _number(env.get("MPSRUN_TASK_ID"))  # a farm's task: its slot in the rank's place
        rank = _number(env.get("RANK") if task is None else env.get("MPSRUN_SLOT"))
        memory = sum(used for used, _ in seen) if seen else None
        peak = max(filter(None, (memory, peaks.get(rank) if rank is not None else None,
                                 self._peaks.get((job, rank)) if rank is not None else None)), default=None)
        if rank is not None and peak is not None:
            self._peaks[(job, rank)] = peak
        limit = env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").partition("=")[2] or None
        with process.oneshot():  # /proc/PID/stat read once for CPU, state and start
            return RankRow(job, rank, here, process.pid, _gpu_index(env.get("CUDA_VISIBLE_DEVICES"), gpus),
                           any(mps for _, mps in seen) if seen else None, memory, peak, limit,
                           _number(env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")), round(process.cpu_percent(), 1),
                           process.memory_info().rss >> 20, process.status(),
                           round(time.time() - process.create_time(), 1), task)


def _order(row: RankRow) -> tuple[str, int, int]:
    return row.job, row.rank if row.rank is not None else -1, row.pid


def _number(text: object) -> int | None:
    """A whole number as mpsrun writes one (in a rank's environment, in usage.json): ASCII digits only, at most
    seven (the most ranks a job has); None for anything else (a rank may set what it likes: '1_0', '٣', 4,000
    digits)."""
    if not isinstance(text, str) or not 0 < len(text) <= _NUMBER_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def _whole(value: object) -> TypeGuard[int]:
    """A JSON number that is a pid or a count of MiB (not a float, not a bool, not of a thousand digits)."""
    return type(value) is int and 0 <= value < 1 << 63


def _contexts_by_rank(contexts: Contexts, rank_pids: set[int]) -> dict[int, list[tuple[int, bool]]]:
    """The CUDA contexts of each rank (by its process's pid): of the rank's process, or of one of its descendants,
    found by walking up each GPU process's parents, a few reads each."""
    parents: dict[int, int] = {}
    found: dict[int, list[tuple[int, bool]]] = {}
    for on_gpu in contexts.values():
        for pid, context in on_gpu.items():
            here = pid
            for _ in range(_MOST_GENERATIONS):
                if here in rank_pids:
                    found.setdefault(here, []).append(context)
                    break
                if here <= 1:
                    break
                if here not in parents:
                    parents[here] = _parent(here)
                here = parents[here]
    return found


def _parent(pid: int) -> int:
    """The parent of process ``pid``; 0 once it is gone."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return 0


def _gpus() -> list[gpu_info.GPU]:
    with contextlib.suppress(MPSError):
        return gpu_info.list_gpus()
    return []


def _contexts(gpus: list[gpu_info.GPU]) -> Contexts:
    """Per GPU, every process with a CUDA context on it: its device memory there (MiB) and whether it is an MPS
    client."""
    found: Contexts = {}
    for gpu in gpus:
        with contextlib.suppress(MPSError):
            memory = gpu_info.process_memory(gpu.uuid)
            found[gpu.uuid] = {pid: (memory.get(pid, 0) >> 20, is_mps)
                               for pid, is_mps in gpu_info.compute_processes(gpu.uuid).items()}
    return found


def _gpu_index(visible: str | None, gpus: list[gpu_info.GPU]) -> int | None:
    """The index of the one GPU a rank sees (by the UUID mpsrun gave it); None for several or none."""
    if not visible or "," in visible:
        return None
    return next((gpu.index for gpu in gpus if visible in (gpu.uuid, str(gpu.index))), None)


def _gpu_rows(gpus: list[gpu_info.GPU], contexts: Contexts) -> list[GpuRow]:
    rows = []
    for gpu in gpus:
        with contextlib.suppress(MPSError):
            used = gpu.memory_total - gpu_info.memory_free(gpu.uuid)
            clients = sum(is_mps for _, is_mps in contexts.get(gpu.uuid, {}).values())
            rows.append(GpuRow(gpu.index, gpu.uuid, gpu_info.utilization(gpu.uuid), used >> 20, gpu.memory_total >> 20,
                               clients))
    return rows


def _published(root: Path) -> dict[int, RankRow]:
    """What a job's controller published (``usage.json``): each rank's host, pid and peak device memory so far, as
    rows of their own (under ``--hosts`` the ranks of the other hosts are shown from it). A rank can write there too:
    the file is read as logs are (no symlink, no FIFO, a bounded size), and an entry not of the shape is left out."""
    try:
        data = json.loads(read_file(SessionDirs(root).usage_file, USAGE_READ_LIMIT))
    except (OSError, ValueError, RecursionError):
        return {}
    rows = {}
    for key, item in data.items() if isinstance(data, dict) else ():
        rank = _number(key)
        if rank is None or not isinstance(item, dict):
            continue
        host, pid, peak = item.get("host"), item.get("pid"), item.get("peak")
        if isinstance(host, str) and _whole(pid) and (peak is None or _whole(peak)):
            rows[rank] = RankRow(root.name, rank, host, pid, None, None, None, peak, None, None, None, None, "remote",
                                 None)
    return rows
