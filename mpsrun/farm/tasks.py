"""A farm's task list: the lines of a task file (``--tasks``), or one command run for each index of a range
(``--array``). Pure functions: nothing runs here.

A task file's line is split as a shell splits words (quotes, backslashes, ``#`` comments) and is never run through
a shell. Blank and comment lines are no tasks; the tasks are numbered from 0 in the order they come.
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO, NamedTuple

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


def _bounded_lines(file: BinaryIO, source: str) -> Iterator[str]:
    """A task file's lines, none read past LINE_MOST bytes: a file with no newline (/dev/zero) is never read whole."""
    for number, line in enumerate(iter(functools.partial(file.readline, LINE_MOST + 1), b""), 1):
        if len(line) > LINE_MOST:
            raise _refused(source, number, _TOO_LONG)
        yield line.decode("utf-8", "surrogateescape")


def read_task_lines(path: str, stdin: BinaryIO) -> list[Task]:
    """The tasks of the task file at ``path`` (``-``: ``stdin``); ConfigError for one that cannot be read."""
    try:
        if path == "-":
            return task_lines(_bounded_lines(stdin, "--tasks - (standard input)"), "--tasks - (standard input)")
        with open(path, "rb") as file:
            return task_lines(_bounded_lines(file, f"--tasks {path}"), f"--tasks {path}")
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: {exc.strerror}", setting="--tasks", value=path) from None


def array_tasks(command: Sequence[str], indices: range) -> list[Task]:
    """``command`` once per index, ``{}`` in its words replaced by the index; the task's number is its index."""
    return [Task(index, tuple(word.replace("{}", str(index)) for word in command)) for index in indices]


def farm_tasks(config: JobConfig) -> tuple[list[Task], dict[int, tuple[str, ...]]]:
    """The farm's whole task list, and the tasks ``--resume`` finds succeeded (by number, with their commands)."""
    if config.tasks is not None:
        tasks = read_task_lines(config.tasks, sys.stdin.buffer)
    else:
        assert config.array is not None
        tasks = array_tasks(config.command, values.parse_index_range(config.array))
    return tasks, succeeded_tasks(config.results) if config.resume and config.results else {}
