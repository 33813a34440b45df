"""The slots of one node's farm: each runs one task at a time and takes the next as soon as it is free.

The farm runs in the ``mpsrun`` command's loop and supervises every slot's task itself: a task is a fresh process in
a group of its own, with its slot's GPU and MPS variables, its output passed on in whole lines (or to its own files
under ``--output-filename``), its end reaped with its CPU time. A failed task is retried (``--retries``) or recorded;
``--max-failures`` stops the taking of tasks. A stop (a signal, ``--timeout``) ends the running tasks and records
them as not finished.

One client's fatal GPU fault ends every client of its MPS server with work in flight, and MPS does not say reliably
whose it was. The server's log names the clients torn down; those tasks are suspects, not failures. One suspect
alone is the culprit; several are run again one at a time, alone on their server: a task that faults alone is
recorded as the fault's, and the others are the fault's victims (run as any task).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from mpsrun.config.values import Queues
from mpsrun.errors import MPSError
from mpsrun.exitcodes import Cause, ExitCode, Outcome, describe_returncode, exit_code
from mpsrun.farm.faults import Fault, ServerFaults
from mpsrun.farm.progress import Progress
from mpsrun.farm.queue import TaskQueue
from mpsrun.farm.results import ResultsFile, TaskCause, TaskResult
from mpsrun.farm.tasks import Task
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.placement import RankPlan, slot_environment
from mpsrun.rank.command import exec_failure_code
from mpsrun.rank.streams import RankOutput, output_files
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.processes import ProcessRef, close_all, find_program, kill_group, pidfd
from mpsrun.session.session import Session

__all__ = ["Farm", "FarmRules", "Slot", "Tally", "slots_of"]

#: Variables every task gets: its number and how many tasks the farm has.
TASK_ID_VARIABLE, TASK_COUNT_VARIABLE, SLOT_VARIABLE = "MPSRUN_TASK_ID", "MPSRUN_TASK_COUNT", "MPSRUN_SLOT"


class FarmRules:
    """What the command line says of the farm: ``retries`` more runs of a failed task, ``max_failures`` (None: no
    limit), ``grace`` before SIGKILL, ``tag`` the output lines, ``output_dir`` for each task's files."""

    __slots__ = ("grace", "max_failures", "output_dir", "retries", "tag")

    def __init__(self, retries: int, max_failures: int | None, grace: float, tag: bool, output_dir: str | None) -> None:
        self.retries, self.max_failures, self.grace, self.tag, self.output_dir = (retries, max_failures, grace, tag,
                                                                                 output_dir)


class Slot:
    """One slot: its number, its GPU (its index, None: no GPU), its server's daemon (None: no MPS) and the variables
    its tasks get."""

    __slots__ = ("daemon", "env", "gpu", "index", "running")

    def __init__(self, index: int, gpu: int | None, daemon: ControlDaemon | None, env: Mapping[str, str]) -> None:
        self.index, self.gpu, self.daemon, self.env = index, gpu, daemon, dict(env)
        self.running: Running | None = None


def slots_of(session: Session, plans: Sequence[RankPlan], queues: Queues) -> list[Slot]:
    """A slot for each plan, on the started ``session``: its GPU's index, the daemon serving it, and the variables its
    work gets (``queues``: --queues)."""
    return [Slot(index, session.gpus[plan.gpu].index if session.gpus else None, session.daemon(plan.gpu),
                 slot_environment(session.target(plan.gpu) if session.gpus else None, plan, queues))
            for index, plan in enumerate(plans)]


class Running:
    """A task running in a slot: its process, when it began (``began`` on the monotonic clock, ``start`` since the
    epoch, both taken before it was started: its wall time holds all of its life), its output, and its try."""

    __slots__ = ("alone", "began", "output", "process", "start", "task", "tries")

    def __init__(self, task: Task, tries: int, process: subprocess.Popen[bytes], output: RankOutput | None,
                 alone: bool, began: float, start: float) -> None:
        self.task, self.tries, self.process, self.output, self.alone = task, tries, process, output, alone
        self.began, self.start = began, start


class Tally:
    """What the farm has done: results by task, the first failure, and the tasks not run."""

    __slots__ = ("failed", "first_failure", "stopped", "succeeded")

    def __init__(self) -> None:
        self.succeeded = self.failed = self.stopped = 0
        self.first_failure: TaskResult | None = None

    def add(self, result: TaskResult) -> None:
        if result.succeeded:
            self.succeeded += 1
        elif result.cause == TaskCause.STOPPED:
            self.stopped += 1
        else:
            self.failed += 1
            if self.first_failure is None:
                self.first_failure = result


#: A task that cannot start for these is refused by the machine (mpsrun's open files, its processes, memory): the
#: farm stops, and no task is recorded as failed for them.
_REFUSALS = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)


class Farm:
    """The node's slots, taking the tasks of ``queue`` (``count``: the whole list's length, for MPSRUN_TASK_COUNT);
    ``base``: the environment tasks start from; ``rules``: the command line's; ``results``: the results file, if any,
    where each finished task's line goes; ``proven``: whether a task (by number and pid) was an MPS client; ``peak``:
    its device memory peak; ``whose``: the task a process of the node's GPUs belongs to, where known; ``say``: a line
    for the user; ``running``: the running tasks, for the session's record (its reaper ends them should we die);
    ``progress``: where the farm stands, for the user."""

    def __init__(self, loop: EventLoop, slots: Sequence[Slot], queue: TaskQueue, count: int,
                 base: Mapping[str, str], rules: FarmRules, results: ResultsFile | None,
                 proven: Callable[[int, int], bool | None], peak: Callable[[int], int | None],
                 whose: Callable[[int], int | None], say: Callable[[str], None],
                 running: Callable[[list[ProcessRef]], None], progress: Progress | None = None) -> None:
        self.loop, self.slots, self.rules, self.results = loop, list(slots), rules, results
        self.queue = queue
        self.count, self.base = count, dict(base)
        self.proven, self.peak, self.whose, self.say, self.running = proven, peak, whose, say, running
        self._unrecorded = False  # tasks started this turn of the loop, not yet in the session's record
        self.progress = progress
        self.tally = Tally()
        self.active: dict[int, Slot] = {}  # the slots running a task, by number
        self.host = socket.gethostname()
        self.stopping: int | None = None
        self.tries: dict[int, int] = {}
        self.suspects: dict[int, collections.deque[Task]] = {}  # by daemon (id): tasks a fault tore down
        self.faults: dict[int, ServerFaults] = {}  # by daemon (id): its server's faults
        self.culprits: set[int] = set()  # tasks that faulted alone: recorded as the fault's, never run again

    # -- taking tasks -------------------------------------------------------------------------------------------

    def start(self) -> None:
        for slot in self.slots:
            self._take(slot)

    @property
    def done(self) -> bool:
        return not self.active and (not self._taking() or not self._left())

    def _left(self) -> bool:
        return self.queue.left() or any(self.suspects.values())

    def _taking(self) -> bool:
        limit = self.rules.max_failures
        return self.stopping is None and (limit is None or self.tally.failed < limit)

    def _take(self, slot: Slot) -> None:
        """Give a free slot its next task: a suspect of its server's fault once the server has no other client,
        else the next task of the list unless its server is finding a culprit."""
        if not self._taking() or slot.running is not None:
            return
        key = id(slot.daemon)
        suspects = self.suspects.get(key)
        if suspects:
            if not self._server_busy(slot.daemon):
                self._spawn(slot, suspects.popleft(), alone=True)
            return
        if self.queue.left() and not self._server_busy(slot.daemon, alone_only=True) and \
                (task := self.queue.take(give_up=lambda: self.loop.signal_noted)) is not None:
            self._spawn(slot, task, alone=False)

    def _server_busy(self, daemon: ControlDaemon | None, alone_only: bool = False) -> bool:
        """Whether a task runs on ``daemon``'s server (``alone_only``: one that must run alone)."""
        return daemon is not None and any(s.daemon is daemon and (s.running.alone or not alone_only)
                                          for s in self.active.values() if s.running is not None)

    def _free(self) -> None:
        for slot in self.slots:
            if slot.running is None:
                self._take(slot)

    # -- a task's life ------------------------------------------------------------------------------------------

    def _spawn(self, slot: Slot, task: Task, alone: bool) -> None:
        tries = self.tries[task.id] = self.tries.get(task.id, 0) + 1
        env = {**self.base, **slot.env, TASK_ID_VARIABLE: str(task.id), TASK_COUNT_VARIABLE: str(self.count),
               SLOT_VARIABLE: str(slot.index)}
        program, code, reason = find_program(task.argv[0], env.get("PATH"))
        if program is None:
            self._say(f"task {task.id}: {task.argv[0]}: {reason}")
            self._record(slot, task, tries, code, None, time.time(), None, None)
            self.loop.after(0, self._free)
            return
        began, start = time.monotonic(), time.time()
        try:
            process, output = self._start(task, program, env)
        except OSError as exc:
            if exc.errno in _REFUSALS:  # the machine's, not the task's: the farm cannot go on
                raise MPSError(f"cannot start task {task.id}: {exc.strerror}") from None
            what = exc.filename if exc.filename and exc.filename != program else task.argv[0]
            self._say(f"task {task.id}: {what}: {exc.strerror}")
            code = exec_failure_code(exc) if what == task.argv[0] else ExitCode.SETUP  # (126, 127, as a shell)
            self._record(slot, task, tries, code, None, time.time(), None, None)
            self.loop.after(0, self._free)
            return
        slot.running = Running(task, tries, process, output, alone, began, start)
        self.active[slot.index] = slot
        if output is not None:
            output.forward()
        exit_fd = pidfd(process.pid)
        assert exit_fd is not None, "Linux 5.3 or later: pidfd_open"
        self.loop.watch(exit_fd, functools.partial(self._exited, slot, exit_fd))
        if not self._unrecorded:  # one record of the running tasks for the tasks that start in one turn
            self._unrecorded = True
            self.loop.after(0, self._record_running)

    def _start(self, task: Task, program: str, env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes],
                                                                            RankOutput | None]:
        """Start ``task``: its output through pipes of ours, passed on in whole lines, or to its own files under
        ``--output-filename``; it reads nothing (tasks at once would split what came). No preexec_fn (a Python
        function between fork and exec makes each start several times slower): a task that outlives a killed farm is
        ended by the session's reaper, which the running tasks are recorded for."""
        output_dir, output = self.rules.output_dir, None
        if output_dir:
            files = output_files(output_dir, f"task.{task.id}")
        else:
            output = RankOutput(self.loop, f"task {task.id}", self.rules.tag, True, None, aside=self.progress)
            files = output.open()
        try:
            process = subprocess.Popen(task.argv, executable=program, env=env, start_new_session=True,
                                       stdin=subprocess.DEVNULL, stdout=files[0], stderr=files[1])
        except OSError:
            if output is not None:
                output.close()
            raise
        finally:
            if output is None:
                close_all(files)
        return process, output

    def _record_running(self) -> None:
        self._unrecorded = False
        found = [ProcessRef.of(s.running.process.pid) for s in self.active.values() if s.running is not None]
        self.running([ref for ref in found if ref is not None])

    def _exited(self, slot: Slot, exit_fd: int) -> None:
        running = slot.running
        assert running is not None
        self.loop.unwatch(exit_fd)
        os.close(exit_fd)
        pid = running.process.pid
        kill_group(pid, signal.SIGKILL)  # what the task left in its group
        _, status, usage = os.wait4(pid, 0)
        running.process.returncode = returncode = os.waitstatus_to_exitcode(status)
        wall, cpu = round(time.monotonic() - running.began, 3), round(usage.ru_utime + usage.ru_stime, 3)
        if running.output is not None:
            running.output.drain()
        slot.running = None
        del self.active[slot.index]
        if returncode != 0 and self.stopping is None and slot.daemon is not None and self._suspect(slot, running):
            self.loop.after(0, self._free)
            return
        if returncode != 0 and self.stopping is None and running.tries <= self.rules.retries and \
                running.task.id not in self.culprits:
            self.queue.again(running.task)
        else:
            cause = TaskCause.FAULT if running.task.id in self.culprits else \
                TaskCause.STOPPED if returncode != 0 and self.stopping is not None else None
            self._record(slot, running.task, running.tries, returncode, pid, running.start, wall, cpu, cause)
        self.loop.after(0, self._free)

    # -- faults ---------------------------------------------------------------------------------------------------

    def _suspect(self, slot: Slot, running: Running) -> bool:
        """Whether the task that failed was torn down by a fatal fault of its server beside other tasks: a suspect,
        to run again alone, its try not counted. One that ran alone, or was the only one torn down, is the fault's
        own (a culprit); a task the fault did not tear down failed on its own."""
        assert slot.daemon is not None
        key, task = id(slot.daemon), running.task
        faults = self.faults.setdefault(key, ServerFaults(slot.daemon, self.whose))
        others = {s.running.process.pid: s.running.task.id for s in self.active.values()
                  if s.running is not None and s.daemon is slot.daemon}
        verdict = faults.judge(task.id, running.process.pid, others, running.alone)
        if verdict is Fault.OWN:
            self.culprits.add(task.id)
            how = "it ran alone on its MPS server" if running.alone else "the only task it tore down"
            self._say(f"task {task.id} caused a fatal GPU fault ({how})")
        if verdict is not Fault.SUSPECT:
            return False
        self.tries[task.id] -= 1
        self.suspects.setdefault(key, collections.deque()).append(task)
        return True

    # -- results --------------------------------------------------------------------------------------------------

    def _record(self, slot: Slot, task: Task, tries: int, returncode: int, pid: int | None, start: float,
                wall: float | None, cpu: float | None, cause: TaskCause | None = None) -> None:
        """A finished task's result (``returncode`` as Popen gives it: -N for signal N), counted and written."""
        result = TaskResult(id=task.id, command=list(task.argv), host=self.host, slot=slot.index, gpu=slot.gpu,
                            exit_code=_code(returncode), cause=str(cause or _cause(returncode)),
                            start=round(start, 3), wall=wall, cpu=cpu,
                            memory_peak=self.peak(task.id), tries=tries,
                            mps=self.proven(task.id, pid) if pid is not None else None)
        self.tally.add(result)
        if self.results is not None:
            self.results.write(result)
        if self.progress is not None:
            running = len(self.active)
            self.progress.update(self.tally.succeeded + self.tally.failed + self.tally.stopped, self.tally.failed,
                                 running)
        if not result.succeeded and cause != TaskCause.STOPPED:
            self._say(f"task {task.id} {describe_returncode(returncode)}" + (f" (try {tries})" if tries > 1 else ""))

    def not_run(self) -> int:
        """Tasks never finished: left in the list, or suspects never run again."""
        return self.queue.not_taken() + sum(len(s) for s in self.suspects.values())

    # -- stopping -------------------------------------------------------------------------------------------------

    def stop(self, sig: int) -> None:
        """Take no more tasks; pass ``sig`` to every running task; SIGKILL after --grace."""
        if self.stopping is None:
            self.stopping = sig
            self.loop.after(self.rules.grace, lambda: self.signal(signal.SIGKILL))
        self.signal(sig)

    def abandon(self) -> None:
        """The farm's loop has ended before its tasks (an error): each running task's group is killed and reaped."""
        for slot in list(self.active.values()):
            if slot.running is not None:
                kill_group(slot.running.process.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(slot.running.process.pid, 0)
                if slot.running.output is not None:
                    slot.running.output.drain()
        self.active.clear()

    def signal(self, sig: int) -> None:
        for slot in self.active.values():
            if slot.running is not None:
                kill_group(slot.running.process.pid, sig)

    def pids(self) -> dict[int, int]:
        """``{pid: task}`` of the running tasks."""
        return {slot.running.process.pid: slot.running.task.id for slot in self.active.values()
                if slot.running is not None}

    def _say(self, text: str) -> None:
        self.say(f"mpsrun: {text}")


def _code(returncode: int) -> int:
    """A task's exit code, as a shell gives it (killed by signal N: 128+N)."""
    return exit_code(Outcome(Cause.RANK_FAILED, returncode)) if returncode else ExitCode.OK


def _cause(returncode: int) -> TaskCause:
    if returncode == ExitCode.OK:
        return TaskCause.OK
    if returncode == ExitCode.NOT_FOUND:
        return TaskCause.NOT_FOUND
    if returncode == ExitCode.NOT_EXECUTABLE:
        return TaskCause.NOT_EXECUTABLE
    return TaskCause.SIGNAL if returncode < 0 else TaskCause.FAILED
