"""Processes by identity: a pid plus its start time, so a reused pid is never signalled.

Standard library only (the rank shim imports it). A :class:`ProcessRef` names one process
exactly: its pid and the kernel's start time (``/proc/<pid>/stat`` field 22, in clock ticks
since boot). Every process mpsrun ends that it did not just spawn itself is checked this way.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterable

TYPE_CHECKING = False  # the rank supervisor imports this: typing's import (3-5 ms) is left out
if TYPE_CHECKING:
    from typing import NamedTuple, NoReturn

    class _Process(NamedTuple):
        pid: int
        start: int
else:
    _Process = collections.namedtuple("_Process", "pid start")

__all__ = [
    "ProcessRef",
    "close_all",
    "exit_now",
    "find_program",
    "flush_output",
    "inherited_fds",
    "kill_group",
    "parent_pid",
    "pidfd",
    "python_without_site",
    "set_parent_death_signal",
    "start_ticks",
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
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def exit_now(code: int) -> NoReturn:
    """End this process at once with ``code``, once its output is flushed: for a process whose work is done
    (whatever it started has ended) and that someone waits on, so the interpreter's teardown of hundreds of
    modules is not sat out."""
    flush_output()
    os._exit(code)


def python_without_site(module: str) -> list[str]:
    """The command that runs ``module.main(sys.argv[1:])`` in a new interpreter started without ``site`` (-S).

    It starts in milliseconds: no site-packages scan, no ``.pth`` hooks (tens of milliseconds on
    some machines), and ends with :func:`exit_now`, without the interpreter's teardown. Only for
    mpsrun's own modules whose imports are the standard library's; mpsrun is found where this
    process found it.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-S", "-c", f"import sys; sys.path.append({root!r}); from {module} import main; "
            "from mpsrun.procs import exit_now; exit_now(main(sys.argv[1:]))"]


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


class ProcessRef(_Process):
    """One process, exactly: pid and start time (a named tuple: the rank shim avoids dataclasses' imports)."""

    __slots__ = ()

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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)
            return True
        return False

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group this process leads, if it still runs and leads it.

        While the leader lives its pid cannot name another group. Once it is gone the group
        may still hold its children: only the group's creator may then use :func:`kill_group`.
        """
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
                return True
        return False

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: object) -> ProcessRef:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("pid", "start")):
            raise ValueError(f"not a process reference: {data!r}")
        return cls(int(data["pid"]), int(data["start"]))


def kill_group(pgid: int, sig: int) -> bool:
    """Signal a process group we lead or created (its leader may have exited); True if any was hit."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def set_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it ends. ``parent``: the pid
    that forked it, read before the fork; one that died before this request sends no signal, so it comes now."""
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def inherited_fds() -> list[int]:
    """Descriptors above 2 that this process inherited and would pass on to a child.

    MPI launchers hand their ranks descriptors (MPICH's ``PMI_FD``, Slurm's PMI2); a rank
    supervisor must pass every one of them to the rank. Descriptors Python opens itself are
    not inheritable (PEP 446), so what is inheritable here came from the parent.
    """
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    found.append(fd)
    return sorted(found)


def find_program(name: str, path: str | None) -> tuple[str | None, int, str]:
    """The program to run for ``name``, or why not, as a shell says it: (None, 127, ...) or (None, 126, ...)."""
    import shutil  # not on the rank shim's path

    found = shutil.which(name, path=path)
    if found is not None:
        return found, 0, ""
    if os.sep in name and os.path.lexists(name):
        return None, 126, "Is a directory" if os.path.isdir(name) else "Permission denied"
    return None, 127, "command not found"


def physical_cores() -> int | None:
    """Physical cores on this host, as Open MPI counts its default slots (None where /sys does not say).

    Read as psutil's ``cpu_count(logical=False)`` reads it (distinct sibling lists), without
    importing psutil (tens of milliseconds) on the mpiexec launcher's path.
    """
    root = "/sys/devices/system/cpu"
    siblings = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.startswith("cpu") and name[3:].isdecimal():
                for part in ("core_cpus_list", "thread_siblings_list"):
                    with contextlib.suppress(OSError), open(f"{root}/{name}/topology/{part}") as file:
                        siblings.add(file.read().strip())
                        break
    return len(siblings) or None


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
