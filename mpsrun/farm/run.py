"""Running a farm: the ``mpsrun --tasks`` / ``--array`` command's part on its node.

It reads the task list (less what ``--resume`` finds done), opens the node's session (the GPUs, the slots' plan, one
MPS daemon per GPU), runs the :class:`~mpsrun.farm.farm.Farm` in its loop with the client watch and the memory
samples, stops it on a signal or ``--timeout``, says the tally in one line, and closes the session whatever happens.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Mapping

from mpsrun.agent.findings import crowding_warnings
from mpsrun.agent.outcome import Policy
from mpsrun.config.options import FARM_OPTIONS, JobConfig, options
from mpsrun.errors import ConfigError, DaemonTimeoutError, JobTimeoutError, MPSError
from mpsrun.exitcodes import Cause, ExitCode, Outcome, exit_code
from mpsrun.farm.farm import Farm, FarmRules, slots_of
from mpsrun.farm.progress import PLAIN_INTERVAL, Progress
from mpsrun.farm.queue import SharedList, TaskQueue
from mpsrun.farm.results import ResultsFile
from mpsrun.farm.tasks import farm_tasks
from mpsrun.job.run import make_output_dir
from mpsrun.mps import gpus
from mpsrun.mps.environment import MANAGED_VARIABLES
from mpsrun.mps.placement import NodePlan, RankPlan, ranks_on_gpus, without_mps
from mpsrun.mps.usage import UsageSampler
from mpsrun.mps.watch import RankWatch, with_descendants
from mpsrun.rank.identity import LOCAL_RANK_VARIABLES, identity_from_env, job_key
from mpsrun.runtime.constants import DAEMON_START_TIMEOUT, FORWARDED_SIGNALS, JOB_ID_VARIABLE, PASS_SIGNALS
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ensure_descriptors
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import session_base
from mpsrun.session.session import Session

__all__ = ["run_farm", "show"]

#: How many of its tasks a farm's --dry-run shows.
TASKS_SHOWN = 10

log = logging.getLogger("mpsrun")


def farm_nodes(environ: Mapping[str, str]) -> int:
    """How many nodes' farms share the task list: the launcher's processes, where it started this one as one of
    them (srun, mpiexec), else 1. A Slurm batch script's own variables (no step) say nothing of the kind; several
    processes of one farm on a node are refused (each would start its own daemons)."""
    identity = identity_from_env(environ)
    slurm_only = not any(name in environ for name in LOCAL_RANK_VARIABLES[:-1])
    if identity is None or (slurm_only and "SLURM_STEP_ID" not in environ):
        return 1
    if (identity.local_world_size or 1) > 1:
        raise ConfigError(f"the launcher started {identity.local_world_size} mpsrun farms on this node: a farm takes "
                          "one mpsrun per node (srun --ntasks-per-node=1, mpiexec -ppn 1), whose -np N slots share "
                          "its GPUs", setting="--tasks")
    return identity.world_size or 1


def shared_list(config: JobConfig, deadline: Deadline) -> SharedList | None:
    """The list the farms of several nodes share through ``--results`` (this node counted in at once, so that it is
    counted out whatever fails next), or None for a farm of its own; its lock waited for until ``deadline``."""
    nodes = farm_nodes(os.environ)
    if nodes == 1:
        return None
    if config.results is None:
        raise ConfigError(f"this farm is one of {nodes} (its launcher's processes): they share the task list through "
                          "--results FILE.jsonl on a file system they all see; give it", setting="--results")
    job = job_key(os.environ)
    if job.startswith("ppid-"):  # (each node's would differ: each would take the whole list)
        raise ConfigError(f"this farm is one of {nodes}, but its launcher names no job they share: set "
                          f"{JOB_ID_VARIABLE} to one value for all of them (the batch job's id)", setting="--results")
    return SharedList(config.results, job, nodes, deadline)


def _base_env(config: JobConfig) -> dict[str, str]:
    """The environment every task starts from: ours, less what mpsrun manages and the farm's own options, with
    ``-x``'s values."""
    farm = {options()[name].variable for name in FARM_OPTIONS}
    env = {name: value for name, value in os.environ.items() if name not in MANAGED_VARIABLES and name not in farm}
    for item in config.exports:
        name, given, value = item.partition("=")
        if given:
            env[name] = value
    return env


#: A slot's descriptors: its task's output pipes and pidfd, and while a task starts its three standard ones and
#: subprocess's error pipe.
_DESCRIPTORS_PER_SLOT = 8


class FarmRun:
    """One farm on this node, from its session's start to its end."""

    def __init__(self, config: JobConfig, queue: TaskQueue, count: int, deadline: Deadline) -> None:
        self.config, self.queue, self.count, self.deadline = config, queue, count, deadline
        self.loop = EventLoop()
        self.policy = Policy.for_job(config, self.deadline)
        self.failure: tuple[int, str] | None = None  # the farm's own (a fatal finding, --timeout)
        self.signalled: int | None = None
        self.farm: Farm | None = None
        self.session: Session | None = None  # once made (it then owns the claim)
        self.progress = Progress(queue.to_run, quiet=config.quiet)

    def run(self, config: JobConfig, claim: SessionClaim, results: ResultsFile | None) -> int:
        """Open the node's session on ``claim``, run the farm to its end, say its tally; the farm's exit code."""
        session, plans = self._open(config, claim)
        watch = RankWatch(session.watcher(), config.mps == "on") if session.enabled else None
        usage = UsageSampler([gpu.uuid for gpu in session.gpus]) if session.gpus else None
        self.farm = farm = Farm(
            self.loop, slots_of(session, plans, config.queues), self.queue, self.count, _base_env(config),
            FarmRules(config.retries, config.max_failures, config.grace, config.tag_output, config.output_filename),
            results, proven=lambda task, pid: _proven(watch, task, pid),
            peak=lambda task: usage.peaks.get(task) if usage is not None else None,
            whose=lambda pid: watch.owner(pid) if watch is not None else None, say=say,
            running=lambda tasks: session.add_ranks(tasks, replacing=True), progress=self.progress)
        with self.loop.signals(FORWARDED_SIGNALS, self._signalled), gpus.nvml_kept():
            self.loop.after(0, farm.start)
            if watch is not None:
                self.loop.after(self.policy.watch_interval, lambda: self._check(watch))
            if usage is not None:
                self.loop.after(self.policy.usage_interval, lambda: self._sample(usage))
            if self.config.timeout is not None:
                self.loop.after(self.deadline.remaining(), self._timed_out)
            if self.progress.plain:
                self.loop.after(PLAIN_INTERVAL, self._say_progress)
            try:
                self.loop.run_until(lambda: farm.done)
            finally:  # also when the loop ended in an error (the results file cannot be written): no task outlives it
                self.progress.close()
                farm.abandon()
        self.loop.close()
        return self._summary()

    def _open(self, config: JobConfig, claim: SessionClaim) -> tuple[Session, list[RankPlan]]:
        """The node's session, its daemons started with the slots' plan (--timeout passing meanwhile is exit 124),
        and the slots' places: as -np asked, but no more than there are tasks."""
        self.session = session = Session(
            gpus=list(config.gpus) if config.gpus is not None else "all", mps=config.mps, keep_logs=config.keep_logs,
            export=False, gpu_bind=config.gpu_bind, start_timeout=max(0.1, self.deadline.cap(DAEMON_START_TIMEOUT)),
            claim=claim)
        session.resolve()
        slots = max(1, min(config.ranks, self.queue.to_run))  # a slot more than tasks would run nothing
        ensure_descriptors(slots, _DESCRIPTORS_PER_SLOT, "slot(s)")
        plan = NodePlan.make(config, len(session.gpus), config.ranks, session.free_memory(), config.ranks)
        plans = plan.ranks(config.ranks)[:slots]  # placed as -np asked (its per-slot lists too), the first used
        try:
            session.start_lazy(plan.daemon_defaults())
        except DaemonTimeoutError as exc:
            if not self.deadline.expired():
                raise
            raise JobTimeoutError(f"timed out after {config.timeout:g} s while the MPS daemons started ({exc})",
                                  timeout=config.timeout or 0.0) from None
        if session.disabled_reason is not None and not config.quiet:
            for line in without_mps(config, session.disabled_reason, gpus_seen=bool(session.gpus)):
                log.warning(f"mpsrun: {line}")
        elif session.disabled_reason is None and config.gpu_bind == "single":
            for line in crowding_warnings(ranks_on_gpus(plans), "slots"):
                log.warning(f"mpsrun: {line}")
        return session, plans

    def _say_progress(self) -> None:
        assert self.farm is not None
        if not self.farm.done:
            say(f"mpsrun: {self.progress.line()}")
            self.loop.after(PLAIN_INTERVAL, self._say_progress)

    def _signalled(self, sig: int) -> None:
        assert self.farm is not None
        if sig in PASS_SIGNALS:
            self.farm.signal(sig)
        elif self.signalled is not None or self.farm.stopping is not None:
            if sig == signal.SIGINT:  # a second Ctrl-C: now; another SIGTERM (`timeout` sends two) waits out --grace
                self.farm.signal(signal.SIGKILL)
        else:
            self.signalled = sig
            self.farm.stop(signal.SIGTERM if sig == signal.SIGHUP else sig)

    def _timed_out(self) -> None:
        assert self.farm is not None
        if self.farm.stopping is None:
            self.failure = (ExitCode.TIMEOUT, f"timed out after {self.config.timeout:g} s")
            say(f"mpsrun: timed out after {self.config.timeout:g} s: stopping the running tasks")
            self.farm.stop(signal.SIGTERM)

    def _check(self, watch: RankWatch) -> None:
        assert self.farm is not None
        if self.farm.stopping is not None:
            return
        for finding in watch.check(self.farm.pids()):
            say(f"mpsrun: {finding.message}" if finding.fatal else f"mpsrun: warning: {finding.message}")
            if finding.fatal and self.failure is None:
                self.failure = (ExitCode.SETUP if finding.code is None else finding.code, finding.message)
                self.farm.stop(signal.SIGTERM)
        self.loop.after(self.policy.watch_interval, lambda: self._check(watch))

    def _sample(self, usage: UsageSampler) -> None:
        assert self.farm is not None
        if self.farm.stopping is None:
            if pids := self.farm.pids():
                usage.sample(with_descendants(pids))
            self.loop.after(self.policy.usage_interval, lambda: self._sample(usage))

    def _summary(self) -> int:
        """The tally in one line (the first failure named), and the farm's exit code: 0 when every task succeeded,
        128+N when stopped by signal N, the farm's own failure's, else the first failed task's."""
        assert self.farm is not None
        tally, farm = self.farm.tally, self.farm
        not_run = farm.not_run() + tally.stopped
        to_run = self.queue.to_run
        resumed = f" ({self.count - to_run} succeeded before)" if self.count != to_run else ""
        where = f"{socket.gethostname()}: this node's part of " if self.queue.shared is not None else ""
        line = (f"{where}{to_run} task(s){resumed}: {tally.succeeded} succeeded, {tally.failed} failed, {not_run} "
                "not run")
        first = tally.first_failure
        if first is not None:
            line += f"; the first to fail: task {first.id} ({first.cause}, exit code {first.exit_code})"
        if not self.config.quiet or first is not None or not_run:
            say(f"mpsrun: {line}")
        if self.signalled is not None:
            return exit_code(Outcome(Cause.SIGNAL, self.signalled))
        if self.failure is not None:
            return self.failure[0]
        return first.exit_code if first is not None else ExitCode.OK


def _proven(watch: RankWatch | None, task: int, pid: int) -> bool | None:
    """Whether task ``task`` (its process ``pid``) was proven an MPS client, seen without MPS, or neither."""
    if watch is None:
        return None
    watch.settle({pid: task})
    return True if task in watch.verified else False if task in watch.without_mps else None


def run_farm(config: JobConfig) -> int:
    """Run ``config``'s farm to its end; its exit code. ConfigError (exit 2) for a task list that cannot be read,
    MPSError for a node that cannot run it (InterruptionError for a signal), before any task starts."""
    deadline = Deadline(config.timeout)  # (from the start: reading the task list included)
    shared = shared_list(config, deadline)
    try:
        tasks, done = farm_tasks(config, deadline)
        make_output_dir(config.output_filename)
        queue = TaskQueue(tasks, done, shared)
        results = ResultsFile(config.results, shared.held if shared else None) if config.results else None
        try:
            return _run(config, FarmRun(config, queue, len(tasks), deadline), results)
        finally:
            if results is not None:
                results.close()
    finally:
        if shared is not None:
            try:
                shared.close()
            except MPSError as exc:  # the farm's own outcome stands
                say(f"mpsrun: {exc}")


def _run(config: JobConfig, farm: FarmRun, results: ResultsFile | None) -> int:
    """The node's session claimed and the farm run; its teardown whatever happens, a signal only noted meanwhile."""
    claim: SessionClaim | None = None
    code = ExitCode.SETUP
    with Interrupts() as interrupts:
        try:
            claim = SessionClaim.make(session_base(None), "job", keep_logs=config.keep_logs)
            code = farm.run(config, claim, results)
        finally:  # from here on a signal is only remembered: the teardown is not cut short
            interrupts.defer_to_the_end()
            code = _close(farm.session, claim, code)
        if interrupts.received:  # while the farm ended
            code = exit_code(Outcome(Cause.OK if code == ExitCode.OK else Cause.DECIDED, code,
                                     late_signal=interrupts.received[0]))
    return code


def _close(session: Session | None, claim: SessionClaim | None, code: int) -> int:
    """The session closed (or the claim released, where no session was made); exit 3 for a teardown that failed
    where the farm had succeeded."""
    try:
        if session is not None:
            session.close()
        elif claim is not None and (errors := claim.release()):
            raise MPSError("session teardown failed: " + "; ".join(map(str, errors)))
    except MPSError as exc:
        say(f"mpsrun: {exc}")
        return ExitCode.SETUP if code == ExitCode.OK else code
    return code


def show(config: JobConfig) -> int:
    """``--dry-run`` of a farm: its slots (each one's GPU, limits and variables) and its first tasks; 0, or what
    refused them. The task list is read (a bad line is refused as the farm would refuse it); nothing starts."""
    from mpsrun.job.dryrun import show as show_plan

    return show_plan(config, lambda: _task_lines(config))


def _task_lines(config: JobConfig) -> list[str]:
    tasks, done = farm_tasks(config, Deadline(config.timeout))
    to_run = [task for task in tasks if done.get(task.id) != task.argv]
    shown = [f"task {task.id}: {task.text}" for task in to_run[:TASKS_SHOWN]]
    more = [f"... and {len(to_run) - TASKS_SHOWN} more"] if len(to_run) > TASKS_SHOWN else []
    resumed = f" ({len(tasks) - len(to_run)} succeeded before: not run again)" if len(tasks) != len(to_run) else ""
    return [f"{len(to_run)} task(s){resumed}:", *shown, *more]
