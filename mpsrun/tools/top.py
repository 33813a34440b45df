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
its owner's pid (``mpsrun status`` lists them). One look is :mod:`mpsrun.tools.topsnapshot`'s; this module shows it,
every line printable (what a rank sets is escaped, never raw), and runs the command.
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
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from mpsrun.agent.account import cell
from mpsrun.config.commandline import OneLineParser
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.output import clipped, printable, say
from mpsrun.tools.topsnapshot import CPU_WINDOW, GpuRow, JobRow, RankRow, Snapshot, Top

if TYPE_CHECKING:  # imported where the live view starts: a pipe or --once needs no curses
    import curses

__all__ = ["GpuRow", "JobRow", "RankRow", "Snapshot", "Top", "main", "render"]

#: The widest cell of the ranks' table, and the most of a job's command line shown (in characters).
_CELL_MOST, _COMMAND_MOST = 32, 100


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
    return clipped(printable(cell(value) if not isinstance(value, str) else value), most)


def _rank(row: RankRow) -> str:
    """A rank's number; a farm's slot with the task it runs (``3: task 17``)."""
    return _text(row.rank) if row.task is None else f"{_text(row.rank)}: task {row.task}"


def render(snapshot: Snapshot) -> list[str]:
    """The snapshot as lines, every one printable (no control character, no escape sequence): the jobs, a table of
    ranks, a table of GPUs (or a line saying that NVML sees none)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot.time))
    lines = [f"mpsrun top - {stamp} - {len(snapshot.jobs)} job(s), {len(snapshot.ranks)} rank(s) on "
             f"{_text(socket.gethostname())}"]
    lines += [f"  job {_text(job.session)} ({_text(job.kind)}, pid {job.owner}, {_time(job.age)}): "
              f"{_text(' '.join(printable(word) for word in job.command), _COMMAND_MOST)}" for job in snapshot.jobs]
    ranks = [[_text(r.job), _rank(r), _text(r.host), str(r.pid), _text(r.gpu), _text(r.mps), _text(r.memory),
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
        say(f"mpsrun top: error: no running job {args.job} of yours here (mpsrun status lists them)")
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
