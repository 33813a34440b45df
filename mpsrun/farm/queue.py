"""Where a farm's slots take their tasks: the node's own list, or one list shared by the farms of several nodes.

Under Slurm one ``mpsrun`` runs on each node (``srun --ntasks-per-node=1 mpsrun -np 8 --tasks FILE --results
R.jsonl``), each reading the same task list. They take its tasks in order through a counter kept beside the results
file, on the shared file system, under a file lock (filelock): each task goes to exactly one node. A task to run
again (a retry, a fault's suspect) stays on its node. The node that ends last (the launcher says how many there
are) removes the counter and its lock.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mpsrun.errors import JobTimeoutError, MPSError
from mpsrun.farm.tasks import Task
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.files import read_file, replace_file

if TYPE_CHECKING:
    from filelock import BaseFileLock

__all__ = ["SharedList", "TaskQueue"]

#: How long a node waits for the shared list's lock before it gives up (another node holds it that long: hung), and
#: how often it looks whether a signal came meanwhile.
LOCK_PATIENCE, LOCK_POLL = 60.0, 0.1


class SharedList:
    """The counter of a task list that the farms of ``nodes`` nodes share (``job``: their launcher's job, which a
    counter left by another job is not), beside the results file at ``results``. Its lock is waited for until the
    job's ``deadline`` at most (--timeout: another process may hold it for good)."""

    def __init__(self, results: str, job: str, nodes: int, deadline: Deadline) -> None:
        from filelock import FileLock  # only farms over several nodes take it

        self.path, self.job, self.nodes, self.deadline = f"{results}.queue", job, nodes, deadline
        self.lock: BaseFileLock = FileLock(f"{results}.lock", timeout=LOCK_PATIENCE)
        with self.held() as held:
            if not held:
                raise JobTimeoutError(f"timed out after {deadline.seconds:g} s while another node held the farm's "
                                      f"shared task list ({self.lock.lock_file})", timeout=deadline.seconds or 0.0)
            state = self._read()
            self._write({"job": job, "next": 0, "ended": 0} if state.get("job") != job else state)

    @contextlib.contextmanager
    def held(self, give_up: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """The list's lock held (True), or not where ``give_up`` says so while waiting for it, or the job's deadline
        passes (False: the farm's loop has the signal or the timeout to deliver); MPSError naming the lock when
        another node holds it past LOCK_PATIENCE."""
        from filelock import Timeout

        deadline = time.monotonic() + LOCK_PATIENCE
        while True:
            try:
                self.lock.acquire(timeout=LOCK_POLL)
                break
            except Timeout:
                if give_up() or self.deadline.expired():
                    yield False
                    return
                if time.monotonic() > deadline:
                    raise MPSError(f"the farm's shared task list is locked by another node for more than "
                                   f"{LOCK_PATIENCE:g} s ({self.lock.lock_file}): is a node hung?") from None
            except OSError as exc:  # (a directory, a loop of links, planted there)
                raise MPSError(f"cannot lock the farm's shared task list ({self.lock.lock_file}): "
                               f"{exc.strerror}") from None
        try:
            yield True
        finally:
            self.lock.release()

    def _read(self) -> dict[str, object]:
        """The counter's state; {} where there is none (or no regular file of ours: a planted FIFO is never opened,
        it would wait for a writer)."""
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(read_file(self.path, 1 << 16))
            if isinstance(found, dict):
                return found
        return {}

    def _write(self, state: Mapping[str, object]) -> None:
        try:
            replace_file(Path(self.path), json.dumps(state).encode())
        except OSError as exc:
            raise MPSError(f"cannot write the farm's shared task list {self.path}: {exc.strerror}") from None

    def take(self, skip: Sequence[bool], give_up: Callable[[], bool]) -> int | bool | None:
        """The next task's place in the list, taken for this node; None when every task is taken; False where
        ``give_up`` said so as the lock was awaited. ``skip``: the places this node does not run (they succeeded
        before: --resume), passed over."""
        with self.held(give_up) as held:
            if not held:
                return False
            state = self._read()
            place = state.get("next") if state.get("job") == self.job else None
            if type(place) is not int or place < 0:  # removed or replaced under us: each task is this node's no more
                raise MPSError(f"the farm's shared task list {self.path} was removed or changed by another program: "
                               "no task is taken from it any more")
            while place < len(skip) and skip[place]:
                place += 1
            if place >= len(skip):
                self._write({**state, "next": place})
                return None
            self._write({**state, "next": place + 1})
            return place

    def close(self) -> None:
        """This node's farm has ended: the last node's end removes the counter and the lock (not counted where the
        lock is held past the job's deadline)."""
        with self.held() as held:
            if not held:
                return
            state = self._read()
            if state.get("job") != self.job:
                return
            ended = state.get("ended", 0)
            ended = (ended if type(ended) is int and ended >= 0 else 0) + 1
            if ended < self.nodes:
                self._write({**state, "ended": ended})
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock.lock_file)


class TaskQueue:
    """A farm's tasks to run, in order: ``tasks`` (the whole list, with ``done``: those not to run again), taken
    here or through the ``shared`` list; tasks to run again come first."""

    def __init__(self, tasks: Sequence[Task], done: Mapping[int, tuple[str, ...]],
                 shared: SharedList | None = None) -> None:
        self.shared = shared
        self._skip = [done.get(task.id) == task.argv for task in tasks]
        self._tasks = list(tasks)
        self._own = collections.deque(task for task, skip in zip(tasks, self._skip, strict=True) if not skip) \
            if shared is None else collections.deque()
        self._again: collections.deque[Task] = collections.deque()
        self._exhausted = False  # the shared list has no task left to take

    @property
    def to_run(self) -> int:
        """How many tasks of the list are to run (all nodes together)."""
        return self._skip.count(False)

    def take(self, give_up: Callable[[], bool] = lambda: False) -> Task | None:
        """The next task, or None (none left; or ``give_up`` said so as the shared list's lock was awaited)."""
        if self._again:
            return self._again.popleft()
        if self.shared is None:
            return self._own.popleft() if self._own else None
        if self._exhausted:
            return None
        place = self.shared.take(self._skip, give_up)
        self._exhausted = place is None
        return None if place is None or place is False else self._tasks[place]

    def again(self, task: Task) -> None:
        """Run ``task`` again, before the tasks not yet taken."""
        self._again.append(task)

    def left(self) -> bool:
        """Whether a task may still be taken (of a shared list: until a take found none)."""
        return bool(self._again or self._own) or (self.shared is not None and not self._exhausted)

    def not_taken(self) -> int:
        """Tasks this node never took: to run again, or (of its own list) not yet taken."""
        return len(self._again) + len(self._own)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
