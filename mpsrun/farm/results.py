"""A farm's results file (``--results FILE.jsonl``): one JSON line per finished task, appended and flushed as each
task ends, so nothing finished is lost whatever stops the job; read back by ``--resume`` (GNU parallel's
``--joblog`` and ``--resume`` are the model).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import NamedTuple

from mpsrun.errors import ConfigError, JobTimeoutError, MPSError
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.files import write_all

__all__ = ["ResultsFile", "TaskCause", "TaskResult", "succeeded_tasks"]


class TaskCause(str, enum.Enum):
    """How a task ended. ``failed``: a non-zero exit; ``signal``: killed by a signal (exit code 128+N); ``fault``: it
    caused a fatal GPU fault (it faulted again running alone); ``stopped``: the job was stopped (a signal, --timeout)
    before it finished: ``--resume`` runs it again."""

    OK = "ok"
    FAILED = "failed"
    SIGNAL = "signal"
    NOT_FOUND = "not-found"
    NOT_EXECUTABLE = "not-executable"
    FAULT = "fault"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


class TaskResult(NamedTuple):
    """One finished task, as its results line says it: ``start`` in seconds since the epoch, ``wall`` and ``cpu`` in
    seconds, ``memory_peak`` in MiB (None: not sampled), ``mps``: proven an MPS client (None: no context seen or no
    MPS), ``tries``: how many times it ran."""

    id: int
    command: list[str]
    host: str
    slot: int
    gpu: int | None
    exit_code: int
    cause: str
    start: float
    wall: float | None
    cpu: float | None
    memory_peak: int | None
    tries: int
    mps: bool | None

    @property
    def succeeded(self) -> bool:
        return self.cause == TaskCause.OK


#: The longest results line read back by --resume (a task's command line is at most the kernel's 2 MiB).
LINE_LIMIT = 1 << 22


class ResultsFile:
    """The results file, open for appending; each :meth:`write` is one whole line, flushed at once (with ``lock()``
    held, where the farms of several nodes append to it: appends over a network file system are not atomic). A last
    line cut short (a farm killed as it wrote) is ended first, so the next line is whole."""

    def __init__(self, path: str, lock: Callable[[], AbstractContextManager[object]] | None = None) -> None:
        self.path, self.lock = path, lock
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as exc:  # ENXIO: a FIFO that no one reads (opened blocking, the farm would wait for one)
            why = "a FIFO that no one reads" if exc.errno == errno.ENXIO else exc.strerror
            raise ConfigError(f"--results {path}: {why}", setting="--results", value=path) from None
        self._fd: int | None = fd  # left non-blocking: a FIFO's reader that stops reading is an error, not a wait
        if not _ends_whole(path):
            try:
                self._write(b"\n", "the end of its cut-short last line")
            except MPSError:
                self.close()
                raise

    def write(self, result: TaskResult) -> None:
        """One result's line; MPSError naming the file where it cannot be written (a full disk, a FIFO no longer
        read): the farm stops."""
        line = json.dumps(result._asdict(), separators=(",", ":")) + "\n"
        self._write(line.encode(), f"task {result.id}'s result")

    def _write(self, data: bytes, what: str) -> None:
        assert self._fd is not None
        try:
            with self.lock() if self.lock is not None else contextlib.nullcontext():
                write_all(self._fd, data, self.path)
        except OSError as exc:
            raise MPSError(f"--results {self.path}: cannot write {what}: {exc.strerror}") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ends_whole(path: str) -> bool:
    """Whether a regular file at ``path`` is empty or ends with a newline (anything else: as if it did)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO opened to be read would wait for a writer)
            with open(path, "rb") as file:
                if file.seek(0, os.SEEK_END) > 0:
                    file.seek(-1, os.SEEK_END)
                    return file.read(1) == b"\n"
    return True


def _lines(path: str, deadline: Deadline) -> Iterator[dict[str, object]]:
    """The JSON objects of a results file, in order, read until ``deadline`` at most (JobTimeoutError); a line that
    is not one (cut short as its job was killed, or longer than LINE_LIMIT) is skipped. A results file that is no
    regular file is not read back."""
    def overdue() -> bool:
        if deadline.expired():
            raise JobTimeoutError(f"timed out after {deadline.seconds:g} s while --resume read back --results {path}",
                                  timeout=deadline.seconds or 0.0)
        return False

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO opened to be read would wait for a writer)
            raise ConfigError(f"--resume reads back --results {path}: not a regular file", setting="--resume",
                              value=path)
        with open(path, "rb") as file:
            while (line := file.readline(LINE_LIMIT)) and not overdue():
                if not line.endswith(b"\n") and len(line) == LINE_LIMIT:
                    while (rest := file.readline(LINE_LIMIT)) and not rest.endswith(b"\n") and not overdue():
                        pass
                    continue
                with contextlib.suppress(ValueError, RecursionError):
                    found = json.loads(line.decode(errors="replace"))
                    if isinstance(found, dict):
                        yield found
    except FileNotFoundError:
        return
    except JobTimeoutError:  # (a TimeoutError, so an OSError)
        raise
    except OSError as exc:
        raise ConfigError(f"--resume: cannot read --results {path}: {exc.strerror}", setting="--resume",
                          value=path) from None


def succeeded_tasks(path: str, deadline: Deadline) -> dict[int, tuple[str, ...]]:
    """``--resume``: the tasks a results file records as succeeded, by number, with their commands (a task whose
    command has changed since is not the one that succeeded); read until ``deadline`` at most."""
    done: dict[int, tuple[str, ...]] = {}
    for line in _lines(path, deadline):
        task, command = line.get("id"), line.get("command")
        if line.get("cause") == TaskCause.OK and type(task) is int and isinstance(command, list):
            done[task] = tuple(map(str, command))
    return done
