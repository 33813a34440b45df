"""What MPI leaves on a node when a job aborts, found and removed once the job is over.

MPICH (4 and later) keeps a world's shared memory in ``/dev/shm/mpich_shm_<world>_<node>`` (and ``mpich_vci_``),
removed at ``MPI_Finalize``; Hydra's proxy writes the node's topology to ``/tmp/hydra_hwloc_xmlfile_XXXXXX`` and holds
it open until it exits, removing it then. An ``MPI_Abort`` skips both: every aborted MPICH job left one of each (and
``mpiexec -n 3 python -m mpi4py`` alone does the same). Neither can be put elsewhere.

A file is removed only if it is this user's, a regular file (never through a link), made since the job began, and
no live process holds it open or mapped: a concurrent job's files are in use, so only what nobody uses is removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable

__all__ = ["MPI_LEFTOVERS", "holders", "left_behind", "sweep"]

#: Where MPICH and Hydra leave files, and how their names begin.
MPI_LEFTOVERS = (("/dev/shm", ("mpich_shm_", "mpich_vci_")), ("/tmp", ("hydra_hwloc_xmlfile_",)))
#: A file's times are read to the second on some file systems: one made as the job began still counts.
_CLOCK_SLACK = 1.0


def left_behind(since: float, places: Iterable[tuple[str, tuple[str, ...]]] = MPI_LEFTOVERS) -> list[str]:
    """This user's regular files of MPI's names, made (or written) at ``since`` (a ``time.time()``) or later."""
    found = []
    for directory, prefixes in places:
        try:
            names = [name for name in os.listdir(directory) if name.startswith(prefixes)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_mtime >= since - _CLOCK_SLACK:
                    found.append(path)
    return found


def holders(paths: Iterable[str]) -> dict[str, set[int]]:
    """The live processes (pids) that hold each of ``paths`` open or mapped, of those this process may look at."""
    wanted = set(paths)
    held: dict[str, set[int]] = {path: set() for path in wanted}
    if not wanted:
        return held
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            for path in _held_by(int(entry), wanted):
                held[path].add(int(entry))
    return held


def _held_by(pid: int, wanted: set[str]) -> set[str]:
    """Which of ``wanted`` process ``pid`` has open or mapped (nothing, if it is gone or not ours to read)."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in wanted:
                    found.add(target)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if path in wanted:
                found.add(path)
    return found


def sweep(since: float, places: Iterable[tuple[str, tuple[str, ...]]] = MPI_LEFTOVERS
          ) -> tuple[list[str], dict[str, set[int]]]:
    """Remove what MPI left since ``since`` and nobody holds; what was removed, and the files still held (by whom)."""
    candidates = left_behind(since, places)
    held = {path: pids for path, pids in holders(candidates).items() if pids}
    removed = []
    for path in candidates:
        if path not in held:
            with contextlib.suppress(FileNotFoundError):  # (unlink removes a link itself, never what it names)
                os.unlink(path)
                removed.append(path)
    return removed, held
