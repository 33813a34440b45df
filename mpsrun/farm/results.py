"""A farm's results file (``--results FILE.jsonl``): one JSON line per finished task, appended and flushed as each
task ends, so nothing finished is lost whatever stops the job; read back by ``--resume`` (GNU parallel's
``--joblog`` and ``--resume`` are the model).
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import IO, NamedTuple

from mpsrun.errors import ConfigError

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


class ResultsFile:
    """The results file, open for appending; each :meth:`write` is one whole line, flushed at once (with ``lock()``
    held, where the farms of several nodes append to it: appends over a network file system are not atomic)."""

    def __init__(self, path: str, lock: Callable[[], AbstractContextManager[object]] | None = None) -> None:
        self.path, self.lock = path, lock
        try:
            self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise ConfigError(f"--results {path}: {exc.strerror}", setting="--results", value=path) from None

    def write(self, result: TaskResult) -> None:
        assert self._file is not None
        with self.lock() if self.lock is not None else contextlib.nullcontext():
            self._file.write(json.dumps(result._asdict(), separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _lines(path: str) -> Iterator[dict[str, object]]:
    """The JSON objects of a results file, in order; a line that is not one (cut short as its job was killed) is
    skipped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            for line in file:
                with contextlib.suppress(ValueError):
                    found = json.loads(line)
                    if isinstance(found, dict):
                        yield found
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"--resume: cannot read --results {path}: {exc.strerror}", setting="--resume",
                          value=path) from None


def succeeded_tasks(path: str) -> dict[int, tuple[str, ...]]:
    """``--resume``: the tasks a results file records as succeeded, by number, with their commands (a task whose
    command has changed since is not the one that succeeded)."""
    done: dict[int, tuple[str, ...]] = {}
    for line in _lines(path):
        task, command = line.get("id"), line.get("command")
        if line.get("cause") == TaskCause.OK and isinstance(task, int) and isinstance(command, list):
            done[task] = tuple(map(str, command))
    return done
