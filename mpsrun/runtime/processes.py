"""Processes by identity: a pid plus its start time, so a reused pid is never signalled.

A :class:`ProcessRef` names one process exactly: its pid and the kernel's start time
(``/proc/<pid>/stat`` field 22, in clock ticks since boot). Every process mpsrun ends that it did
not just spawn itself is checked this way. Also here: how mpsrun starts its own helper processes,
and the shell's rules for a command that cannot be run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple, NoReturn

from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.deadline import Deadline, poll_until

__all__ = [
    "ProcessRef",
    "close_all",
    "descendants",
    "end_processes",
    "ensure_descriptors",
    "exit_now",
    "find_program",
    "flush_output",
    "kill_group",
    "kill_group_but_leader",
    "open_standard_descriptors",
    "own_module",
    "parent_pid",
    "pidfd",
    "python_without_site",
    "set_parent_death_signal",
    "start_ticks",
    "wait",
]

_PR_SET_PDEATHSIG = 1
#: Looked up here, in the parent: a forked child must not dlopen() (another thread, importing an extension
#: module or loading NVML, may hold the loader's lock at the fork, and the child would wait for it forever).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def flush_output() -> None:
    """Write out what Python holds of stdout and stderr (a closed or broken stream: nothing more to say there)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: started with that descriptor closed
            with contextlib.suppress(OSError, ValueError):
                stream.flush()


def open_standard_descriptors() -> None:
    """Put /dev/null on stdin, stdout or stderr where we were started with it closed (``cmd >&-``): else the
    next file or socket we open takes that number, and the ranks, which inherit 0-2, would read or write it."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if opened != fd:
                os.close(opened)
                continue
            os.set_inheritable(fd, True)  # as a standard descriptor is (os.open's are not)
            if getattr(sys, name) is None:  # Python found it closed too: its stream writes there now
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115 - for life


def exit_now(code: int) -> NoReturn:
    """End this process at once with ``code``, once its output is flushed: for a process whose work is done
    (whatever it started has ended) and that someone waits on, so the interpreter's teardown of hundreds of
    modules is not sat out."""
    flush_output()
    os._exit(code)


def python_without_site(module: str, prelude: str = "") -> list[str]:
    """The command that runs ``module.main(sys.argv[1:])`` in a new interpreter started without ``site`` (-S).

    For mpsrun's own processes that start once per rank or per session (rank supervisors, reapers): no
    site-packages scan and no ``.pth`` hooks (tens of milliseconds on machines with many packages), so
    such a module imports only the standard library (a test holds that line).
    """
    return own_module(module, site=False, prelude=prelude)


def own_module(module: str, site: bool = True, prelude: str = "") -> list[str]:
    """The command that runs mpsrun's ``module.main(sys.argv[1:])`` in a new interpreter (``site``: with
    site-packages). mpsrun is found where this process found it, and nothing is imported from the working
    directory (``-m`` and ``-c`` put it first on the path, where another checkout of mpsrun, or a
    ``math.py``, would otherwise win). ``prelude``: statements run first, before anything of mpsrun is imported."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, *(() if site else ("-S",)), "-c",
            f"import sys\n{prelude}\nsys.path[:] = [{root!r}, *(p for p in sys.path if p)]\nfrom {module} import main\n"
            "from mpsrun.runtime.processes import exit_now\nexit_now(main(sys.argv[1:]))"]


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


class ProcessRef(NamedTuple):
    """One process, exactly: pid and start time."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        start = start_ticks(pid)
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        """True while this very process runs (a zombie has finished and counts as gone)."""
        fields = _stat_fields(self.pid)
        if not fields or len(fields) <= 19:
            return False
        return int(fields[19]) == self.start and fields[0] != "Z"

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to this process if it is still the same one; True if sent."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group this process leads, if it still runs and leads it.

        While the leader lives its pid cannot name another group. Once it is gone the group
        may still hold its children: only the group's creator may then use :func:`kill_group`.
        """
        if not self.alive():
            return False
        try:
            if os.getpgid(self.pid) != self.pid:
                return False
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: object) -> ProcessRef:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("pid", "start")):
            raise ValueError(f"not a process reference: {data!r}")
        return cls(int(data["pid"]), int(data["start"]))


def descendants(pid: int) -> list[ProcessRef]:
    """Every process under ``pid`` now (children's children too), each exactly; [] once it is gone."""
    import psutil  # only where a launcher is stopped: not on a job's way to its ranks

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [ref for child in children if (ref := ProcessRef.of(child.pid)) is not None]


def kill_group(pgid: int, sig: int) -> bool:
    """Signal a process group we lead or created (its leader may have exited); True if any was hit."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group_but_leader(pgid: int, sig: int) -> None:
    """Signal every process of the group that ``pgid`` leads but its leader (which is to go on a moment yet). Each
    member found in /proc is held by a pidfd and checked again before the signal, so a reused pid is never hit."""
    for name in os.listdir("/proc"):
        if not name.isdecimal() or int(name) == pgid or _group_of(int(name)) != pgid:
            continue
        with contextlib.suppress(OSError):
            member = os.pidfd_open(int(name))
            try:
                if _group_of(int(name)) == pgid:  # still the process found: the pidfd pins it
                    signal.pidfd_send_signal(member, sig)
            finally:
                os.close(member)


def _group_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[2]) if fields else None  # pgrp: field 5 of /proc/<pid>/stat


def set_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it ends. ``parent``: the pid
    that forked it, read before the fork; one that died before this request sends no signal, so it comes now."""
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


#: Descriptors a controller holds apart from its ranks' (listener, epoll, the daemons' pipes, NVML, logs), with room.
_BASE_DESCRIPTORS = 64
#: Each rank's link to its controller, and for a forked supervisor its pidfd, with room.
_DESCRIPTORS_PER_RANK = 3


def ensure_descriptors(ranks: int, per_rank: int = _DESCRIPTORS_PER_RANK, what: str = "rank(s)") -> None:
    """Make sure this process may open the descriptors a controller of ``ranks`` ranks (``what``: a farm's slots,
    ``per_rank`` each) holds: raise the soft limit (``ulimit -n``) up to the hard one if it is lower; MPSError (exit
    3) if even the hard limit is too low, before anything starts (a job that ran out of descriptors half-way could not
    even end cleanly)."""
    needed = _BASE_DESCRIPTORS + per_rank * ranks
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise MPSError(f"{ranks} {what} need about {needed} open files here, and this process may open only {hard} "
                       f"(ulimit -n); raise the limit or start fewer {what.removesuffix('(s)')}s per node")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def find_program(name: str, path: str | None) -> tuple[str | None, int, str]:
    """The program to run for ``name``, or why not, as a shell says it: (None, exit code, words)."""
    found = shutil.which(name, path=path)
    if found is not None:
        return found, ExitCode.OK, ""
    script = name.endswith(".py")
    if os.sep in name and os.path.lexists(name):
        if os.path.isdir(name):
            return None, ExitCode.NOT_EXECUTABLE, "Is a directory"
        hint = f" (did you mean python {name}?)" if script else ""
        return None, ExitCode.NOT_EXECUTABLE, f"Permission denied{hint}"
    if os.sep not in name and (script or os.path.isfile(name)):  # a file here, named as a command
        return None, ExitCode.NOT_FOUND, f"command not found (did you mean {'python ' if script else './'}{name}?)"
    return None, ExitCode.NOT_FOUND, "command not found"


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (None where the kernel has none)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def wait(pid: int, block: bool = True) -> int | None:
    """The exit status of our child ``pid`` as ``Popen.returncode`` gives it (-N: killed by signal N); None while it
    runs (``block=False``)."""
    done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def end_processes(processes: Sequence[ProcessRef], grace: float) -> None:
    """End ``processes``: SIGTERM, then SIGKILL for those still running ``grace`` seconds later."""
    for process in processes:
        process.signal(signal.SIGTERM)
    poll_until(lambda: not any(process.alive() for process in processes) or None, Deadline(grace))
    for process in processes:
        process.signal(signal.SIGKILL)
