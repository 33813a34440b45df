"""A farm's task list: the lines of a task file (``--tasks``), or one command run for each index of a range
(``--array``). Nothing runs here.

A task file's line is split as a shell splits words (quotes, backslashes, ``#`` comments) and is never run through
a shell. Blank and comment lines are no tasks; the tasks are numbered from 0 in the order they come.
"""

from __future__ import annotations

import math
import os
import re
import select
import shlex
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.config.values import MAX_TASKS
from mpsrun.errors import ConfigError, JobTimeoutError
from mpsrun.farm.results import succeeded_tasks
from mpsrun.runtime.deadline import Deadline

__all__ = ["LINE_MOST", "Task", "array_tasks", "farm_tasks", "read_task_lines", "task_lines"]

#: The longest task line: longer ones are typos (a file read as tasks), and shlex splits a word in time quadratic in
#: its length (a word of 1 MB took 50 s, of 200 KB 6 to 19 s; of 64 KiB well under a second).
LINE_MOST = 1 << 16



class Task(NamedTuple):
    """One task: its number (``MPSRUN_TASK_ID``) and its command line."""

    id: int
    argv: tuple[str, ...]

    @property
    def text(self) -> str:
        """The command as a shell would read it back."""
        return shlex.join(self.argv)


#: A line with no quote, backslash or comment: its words are what lies between blanks, as shlex would find them
#: (shlex reads a character at a time: a million such lines took it 20 s).
_PLAIN = re.compile(r"[^'\"\\#]*\Z")
_BLANKS = re.compile(r"[ \t\r\n]+")


_TOO_LONG = f"longer than {LINE_MOST >> 10} KiB"


def _refused(source: str, number: int, why: str) -> ConfigError:
    return ConfigError(f"{source} line {number}: {why}", setting="--tasks", value=number)


def task_lines(lines: Iterable[str], source: str = "--tasks") -> list[Task]:
    """The tasks of a task file's ``lines``; ConfigError naming the line for one a shell could not split."""
    tasks: list[Task] = []
    for number, line in enumerate(lines, 1):
        why = "a NUL character (no command line can hold one)" if "\0" in line else \
            _TOO_LONG if len(line) > LINE_MOST else ""
        if why:
            raise _refused(source, number, why)
        try:
            argv = [word for word in _BLANKS.split(line) if word] if _PLAIN.match(line) else \
                shlex.split(line, comments=True)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise ConfigError(f"{source} line {number}: {str(exc).lower()}: {line.rstrip()!r}",
                              setting="--tasks", value=line) from None
        if argv:
            tasks.append(Task(len(tasks), tuple(argv)))
        if len(tasks) > MAX_TASKS:
            raise ConfigError(f"{source}: more than {MAX_TASKS} tasks", setting="--tasks")
    return tasks


def _bounded_lines(fd: int, source: str, deadline: Deadline) -> Iterator[str]:
    """The lines read from ``fd``, none past LINE_MOST bytes (a file with no newline, /dev/zero, is never read whole);
    each read waited for until ``deadline`` at most (a FIFO no one writes to, a pipe its writer keeps open)."""
    pending, number = b"", 0
    while chunk := _read(fd, source, deadline):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            number += 1
            if len(line) >= LINE_MOST:
                raise _refused(source, number, _TOO_LONG)
            yield line.decode("utf-8", "surrogateescape")
        if len(pending) > LINE_MOST:
            raise _refused(source, number + 1, _TOO_LONG)
    if pending:
        yield pending.decode("utf-8", "surrogateescape")


def _read(fd: int, source: str, deadline: Deadline) -> bytes:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if deadline.expired() or \
            not poller.poll(None if deadline.seconds is None else math.ceil(deadline.remaining() * 1000)):
        raise JobTimeoutError(f"timed out after {deadline.seconds:g} s while reading the task list ({source})",
                              timeout=deadline.seconds or 0.0)
    return os.read(fd, 1 << 16)


def read_task_lines(path: str, stdin: int, deadline: Deadline) -> list[Task]:
    """The tasks of the task file at ``path`` (``-``: the descriptor ``stdin``), read until ``deadline`` at most
    (JobTimeoutError); ConfigError for one that cannot be read."""
    source = "--tasks - (standard input)" if path == "-" else f"--tasks {path}"
    try:
        if path == "-":
            return task_lines(_bounded_lines(stdin, source, deadline), source)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO's open waits for a writer: its reads are waited for)
        try:
            os.set_blocking(fd, True)
            return task_lines(_bounded_lines(fd, source, deadline), source)
        finally:
            os.close(fd)
    except JobTimeoutError:  # (a TimeoutError, so an OSError)
        raise
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: {exc.strerror}", setting="--tasks", value=path) from None


def array_tasks(command: Sequence[str], indices: range) -> list[Task]:
    """``command`` once per index, ``{}`` in its words replaced by the index; the task's number is its index."""
    return [Task(index, tuple(word.replace("{}", str(index)) for word in command)) for index in indices]


def farm_tasks(config: JobConfig, deadline: Deadline) -> tuple[list[Task], dict[int, tuple[str, ...]]]:
    """The farm's whole task list, a task file read until ``deadline`` at most, and the tasks ``--resume`` finds
    succeeded (by number, with their commands)."""
    if config.tasks is not None:
        tasks = read_task_lines(config.tasks, 0, deadline)  # (standard input)
    else:
        assert config.array is not None
        tasks = array_tasks(config.command, values.parse_index_range(config.array))
    return tasks, succeeded_tasks(config.results, deadline) if config.resume and config.results else {}
