"""``mpsrun top``: this user's running mpsrun jobs on this node, a row per rank and per GPU. It never changes a job.

Every job's session directory names its owner and its local ranks' processes (``session.json``), and its
controller writes each rank's host, pid and peak device memory so far (``usage.json``). The rest comes from where
``top`` and ``nvidia-smi`` read it: a rank's environment (its rank, GPU and MPS limits, as mpsrun set
them), psutil (CPU, resident memory, state, time running) and NVML (each process's device memory, whether
it is an MPS client, each GPU's SM activity). NVML has no SM figure per MPS client: it charges all of
them to the server, so SM activity is the GPU's.

    mpsrun top [JOB] [--once | --json] [--interval S] [--tmpdir DIR]

Live in a terminal (curses; ``q`` or Ctrl-C leaves), refreshed every second; ``--once`` prints one table,
``--json`` one snapshot; without a terminal it prints a table every interval. ``JOB``: a session's name or
its owner's pid (``mpsrun status`` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import psutil

from mpsrun.config.commandline import OneLineParser
from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.job.account import cell
from mpsrun.mps import gpus as gpu_info
from mpsrun.runtime.files import read_file
from mpsrun.runtime.output import printable
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import SessionDirs
from mpsrun.session.registry import SessionState, list_sessions

if TYPE_CHECKING:  # imported where the live view starts: a pipe or --once needs no curses
    import curses

__all__ = ["GpuRow", "RankRow", "Snapshot", "Top", "main", "render"]

#: Per GPU (by UUID): each process with a context there, its device memory (MiB) and whether it is an MPS client.
Contexts = dict[str, dict[int, tuple[int, bool]]]

#: The most of a session's usage.json that is read (a job of thousands of ranks writes well under this).
USAGE_READ_LIMIT = 1 << 22

#: The first look of a process's CPU use measures from this long before the snapshot (psutil needs two).
CPU_WINDOW = 0.5

#: The most digits of a number read from a rank's environment or usage.json (MAX_RANKS has seven).
_NUMBER_DIGITS = 7

#: The widest cell of the ranks' table, and the most of a job's command line shown (in characters).
_CELL_MOST, _COMMAND_MOST = 32, 100

#: How many generations up from a GPU process its rank is looked for (a rank's program, its children, theirs ...).
_MOST_GENERATIONS = 64


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank now. ``mps``: an MPS client (None: no CUDA context seen); memory in MiB (``memory``: device memory
    now, over the rank's processes; ``peak``: the most its job's controller or this view saw); ``limit``: its
    pinned-memory limit as MPS was given it; ``running``: seconds since it started. A rank on another host of a
    ``--hosts`` job, as its controller here heard of it, has its host, pid and peak only."""

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
        rank = _number(env.get("RANK"))
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
                           round(time.time() - process.create_time(), 1))


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


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [list(header), *rows]) for i in range(len(header))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [list(header), *rows]]


def _text(value: object, most: int = _CELL_MOST) -> str:
    """What a rank, a record or the machine says, for a terminal: escaped where it holds a control character or an
    escape sequence (never raw), and cut at ``most`` characters (a value of thousands would stretch every row)."""
    text = printable(cell(value) if not isinstance(value, str) else value)
    return text if len(text) <= most else text[: most - 3] + "..."


def render(snapshot: Snapshot) -> list[str]:
    """The snapshot as lines, every one printable (no control character, no escape sequence): the jobs, a table of
    ranks, a table of GPUs (or a line saying that NVML sees none)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot.time))
    lines = [f"mpsrun top - {stamp} - {len(snapshot.jobs)} job(s), {len(snapshot.ranks)} rank(s) on "
             f"{_text(socket.gethostname())}"]
    lines += [f"  job {_text(job.session)} ({_text(job.kind)}, pid {job.owner}, {_time(job.age)}): "
              f"{_text(' '.join(printable(word) for word in job.command), _COMMAND_MOST)}" for job in snapshot.jobs]
    ranks = [[_text(r.job), _text(r.rank), _text(r.host), str(r.pid), _text(r.gpu), _text(r.mps), _text(r.memory),
              _text(r.peak), _text(r.limit), _text(r.threads), _text(None if r.cpu is None else round(r.cpu)),
              _text(r.resident), _text(r.state), _time(r.running)]
             for r in snapshot.ranks]
    lines += ["", *_table(("JOB", "RANK", "HOST", "PID", "GPU", "MPS", "MEM MiB", "PEAK", "LIMIT", "SM %", "CPU %",
                           "RSS MiB", "STATE", "TIME"), ranks)]
    if not snapshot.gpus:
        return [*lines, "", "GPU: none that NVML can see"]
    gpus = [[str(g.index), _text(g.sm), f"{g.used}/{g.total}", str(g.clients)] for g in snapshot.gpus]
    return [*lines, "", *_table(("GPU", "SM %", "MEM MiB", "MPS CLIENTS"), gpus)]


def _live(top: Top, interval: float) -> bool:
    """Refresh in the terminal until ``q`` or Ctrl-C; False where curses cannot draw on it (no terminfo for its
    ``TERM``, or no curses in this Python). Once it draws, it never falls back to printing: a line or a terminal
    curses cannot draw all of is drawn in part."""
    try:
        import curses
    except ImportError:
        return False
    drawn = False

    def show(screen: curses.window) -> None:
        nonlocal drawn
        drawn = True
        with contextlib.suppress(curses.error):  # a terminal that cannot hide its cursor
            curses.curs_set(0)
        screen.timeout(int(interval * 1000))
        while True:
            _draw(screen, [*render(top.snapshot()), "", "q: quit"])
            if screen.getch() in (ord("q"), ord("Q")):
                return

    try:
        curses.wrapper(show)
    except curses.error:
        return drawn
    return True


def _draw(screen: curses.window, lines: list[str]) -> None:
    """``lines`` (printable: render made them so) on the screen, each cut at its width and as many as its height
    holds; what curses cannot draw (the last cell of a tiny terminal, a wide character at the edge) is left out."""
    import curses

    screen.erase()
    height, width = screen.getmaxyx()
    for row, line in enumerate(lines[: max(height - 1, 0)]):
        with contextlib.suppress(curses.error):
            screen.addnstr(row, 0, line, max(width - 1, 0))
    with contextlib.suppress(curses.error):
        screen.refresh()


def _snapshots(top: Top, interval: float) -> None:
    """A table every interval, for a pipe or a terminal curses cannot draw on."""
    while True:
        print("\n".join(render(top.snapshot())) + "\n", flush=True)
        time.sleep(interval)


def _seconds(text: str) -> float:
    """``--interval``: a number of seconds, at least 0.1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds of at least 0.1")
    return value


def main(argv: Sequence[str]) -> int:
    parser = OneLineParser(prog="mpsrun top", description="This user's running mpsrun jobs on this node: a row per "
                           "rank (device memory, limits, CPU, state) and per GPU. It never changes a job.")
    parser.add_argument("job", nargs="?", metavar="JOB", help="one job: its session (mpsrun status) or owner's pid")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--once", action="store_true", help="print one table and exit")
    shown.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    parser.add_argument("--interval", type=_seconds, default=1.0, metavar="S", help="seconds between refreshes (1)")
    parser.add_argument("--tmpdir", type=Path, default=None, help="where sessions live (default as for new ones)")
    args = parser.parse_args(argv)
    # A view holds nothing to clean up: Ctrl-C leaves it (as q does), other stopping signals end it at once.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    top = Top(args.tmpdir, args.job)
    if args.job is not None and not top.jobs():
        print(f"mpsrun top: error: no running job {args.job} of yours here (mpsrun status lists them)",
              file=sys.stderr)
        return ExitCode.USAGE
    try:
        if args.once and not top.jobs():
            print(f"mpsrun top: no running mpsrun job of yours on {socket.gethostname()}")
        elif args.once or args.json:
            top.prime()  # starts each rank's CPU measurement
            time.sleep(CPU_WINDOW)
            snapshot = top.snapshot()
            print(json.dumps(asdict(snapshot), indent=1) if args.json else "\n".join(render(snapshot)))
        elif not (sys.stdout.isatty() and _live(top, args.interval)):
            _snapshots(top, args.interval)
    except KeyboardInterrupt:
        pass
    return ExitCode.OK
