"""The GPU list, read in a forked child while the ``mpsrun`` command imports its modules.

NVML's import and initialisation take about 40 ms on the H100 machine, and a local job waits for
them before its daemon can start; a child forked as the command starts does them on a core of its
own meanwhile. :mod:`mpsrun._entry` forks it before importing anything else when the command line
looks like a job on this node (:func:`wanted`); the command line, once parsed, decides for good:
:func:`start` (a no-op when it runs already) or :func:`cancel`. :func:`mpsrun.mps.gpus.list_gpus` takes
the answer (:func:`answer`); a child that failed leaves the query to it.

Built-in modules only: imported before anything else of mpsrun.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # the stubs of ``signal`` describe ``_signal``: ``signal`` without its enums
    import signal as _signal
    from collections.abc import Mapping
else:
    import _signal

__all__ = ["answer", "cancel", "start", "wanted"]

#: What makes the command no job of this node's (each host's node keeper reads its GPUs), or no job at all.
ELSEWHERE = ("--per-node", "--hosts", "--hostfile")
ELSEWHERE_VARIABLES = ("MPSRUN_PER_NODE", "MPSRUN_HOSTS", "MPSRUN_HOSTFILE")
NOT_A_JOB = ("bench", "doctor", "status", "cleanup", "-h", "--help", "--version")

_child: tuple[int, int] | None = None  # (pid, reading end of its pipe)


def wanted(argv: list[str], environ: Mapping[str, str]) -> bool:
    """Whether ``argv`` looks like a job whose GPUs this process reads (a cheap look, before the options are
    parsed: a word taken for an option here, such as a program's own ``--hosts``, only means no early start)."""
    if not argv or argv[0] in NOT_A_JOB:
        return False
    if any(word in ELSEWHERE or word.startswith(tuple(f"{flag}=" for flag in ELSEWHERE)) for word in argv):
        return False
    return not any(environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")
                   for name in ELSEWHERE_VARIABLES)


def start() -> None:
    """Fork the child, unless one runs already (or another thread does: a fork must not copy a lock it holds)."""
    global _child
    threading = sys.modules.get("threading")
    if _child is not None or (threading is not None and threading.active_count() > 1):
        return
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _answer_in_child(write, parent)
    os.close(write)
    _child = (pid, read)


def _answer_in_child(pipe: int, parent: int) -> None:
    code = 1
    try:
        from mpsrun.mps.gpus import write_gpu_list

        write_gpu_list(pipe, parent)
        code = 0
    finally:
        os._exit(code)


def answer() -> bytes | None:
    """The child's answer (the GPU list as JSON), once; None without a child, or when it failed."""
    global _child
    if _child is None:
        return None
    pid, pipe = _child
    _child = None
    with open(pipe, "rb") as reply:
        data = reply.read()
    _, status = os.waitpid(pid, 0)
    return data if status == 0 else None


def cancel() -> None:
    """End the child unheard, if there is one (the command turned out not to be a job of this node)."""
    global _child
    if _child is None:
        return
    pid, pipe = _child
    _child = None
    try:
        os.kill(pid, _signal.SIGKILL)  # ours and not reaped yet: the pid is still the child's
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    os.close(pipe)
