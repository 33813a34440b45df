"""A farm's task list: the lines of a task file (``--tasks``), or one command run for each index of a range
(``--array``). Pure functions: nothing runs here.

A task file's line is split as a shell splits words (quotes, backslashes, ``#`` comments) and is never run through
a shell. Blank and comment lines are no tasks; the tasks are numbered from 0 in the order they come.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.config.values import MAX_TASKS
from mpsrun.errors import ConfigError
from mpsrun.farm.results import succeeded_tasks

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


def task_lines(lines: Iterable[str], source: str = "--tasks") -> list[Task]:
    """The tasks of a task file's ``lines``; ConfigError naming the line for one a shell could not split."""
    tasks: list[Task] = []
    for number, line in enumerate(lines, 1):
        why = "a NUL character (no command line can hold one)" if "\0" in line else \
            f"longer than {LINE_MOST >> 10} KiB" if len(line) > LINE_MOST else ""
        if why:
            raise ConfigError(f"{source} line {number}: {why}", setting="--tasks", value=number)
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise ConfigError(f"{source} line {number}: {str(exc).lower()}: {line.rstrip()!r}",
                              setting="--tasks", value=line) from None
        if argv:
            tasks.append(Task(len(tasks), tuple(argv)))
        if len(tasks) > MAX_TASKS:
            raise ConfigError(f"{source}: more than {MAX_TASKS} tasks", setting="--tasks")
    return tasks


def read_task_lines(path: str, stdin: Iterable[str] | None = None) -> list[Task]:
    """The tasks of the task file at ``path`` (``-``: ``stdin``); ConfigError for one that cannot be read."""
    if path == "-":
        return task_lines(stdin or (), "--tasks - (standard input)")
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            return task_lines(file, f"--tasks {path}")
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: {exc.strerror}", setting="--tasks", value=path) from None


def array_tasks(command: Sequence[str], indices: range) -> list[Task]:
    """``command`` once per index, ``{}`` in its words replaced by the index; the task's number is its index."""
    return [Task(index, tuple(word.replace("{}", str(index)) for word in command)) for index in indices]


def farm_tasks(config: JobConfig) -> tuple[list[Task], dict[int, tuple[str, ...]]]:
    """The farm's whole task list, and the tasks ``--resume`` finds succeeded (by number, with their commands)."""
    if config.tasks is not None:
        tasks = read_task_lines(config.tasks, sys.stdin if config.tasks == "-" else None)
    else:
        assert config.array is not None
        tasks = array_tasks(config.command, values.parse_index_range(config.array))
    return tasks, succeeded_tasks(config.results) if config.resume and config.results else {}
