"""Running a job: check and plan everything, start the session, start the ranks, report, tear down.

The CLI builds a :class:`~mpsrun.config.options.JobConfig` and calls :func:`run_job`; nothing here
parses command lines or exits the interpreter. Every backend goes through the same steps; only what
the backend starts differs (:mod:`mpsrun.job.backends`), and one controller applies the job's
contract to every rank (:class:`~mpsrun.job.jobcontroller.JobController`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    InterruptionError,
    MPSError,
    TeardownError,
)
from mpsrun.exitcodes import ExitCode
from mpsrun.job.backends import Backend, choose_backend
from mpsrun.job.channel import ControlChannel, free_port, listen_address, rendezvous
from mpsrun.job.outcome import Policy
from mpsrun.mps import gpus
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ensure_descriptors, find_program
from mpsrun.session import leftovers
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import session_base

if TYPE_CHECKING:  # imported once the launcher has started (see _AFTER_THE_LAUNCHER)
    from pathlib import Path

    from mpsrun.job.account import RankAccount
    from mpsrun.job.controller import Admit
    from mpsrun.job.jobcontroller import JobController
    from mpsrun.job.nodesession import NodeSession
    from mpsrun.job.outcome import JobResult
    from mpsrun.job.placement import Admission, RankPlan
    from mpsrun.runtime.protocol import Hello
    from mpsrun.session.session import Session

__all__ = ["run_job"]

log = logging.getLogger("mpsrun")

#: What the job needs only once its launcher has started: under --launcher mpiexec, mpiexec starts its ranks
#: meanwhile, and on the local path the daemons come up meanwhile; imported before, they would hold up every
#: job's start (docs/benchmarks.md, "The redesign": the trivial job's A/B).
_AFTER_THE_LAUNCHER = ("mpsrun.session.session", "mpsrun.job.jobcontroller", "mpsrun.job.placement",
                       "mpsrun.job.report", "mpsrun.rank.forked")


def _import_the_rest() -> None:
    for name in _AFTER_THE_LAUNCHER:
        importlib.import_module(name)


def resolve_command(command: tuple[str, ...]) -> str:
    """The program of a job's command by absolute path; raises as a shell would say it (127, 126)."""
    program, code, reason = find_program(command[0], None)
    if program is None:
        error = CommandNotFoundError if code == ExitCode.NOT_FOUND else CommandNotExecutableError
        raise error(f"{command[0]}: {reason}", command=command[0])
    return program


def first_host(config: JobConfig) -> str:
    """Where rank 0 runs: the first host of ``--hosts`` or of the host file (MPI launchers fill hosts in
    order), else this one."""
    names = values.host_names(config.hosts, config.hostfile)
    return names[0] if names else "127.0.0.1"


def make_output_dir(path: str | None) -> None:
    """``--output-filename``'s directory, made here first: a directory that cannot be made is one line, not one
    per rank (each rank's supervisor makes its own ``rank.N`` in it)."""
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise MPSError(f"--output-filename {path}: {exc.strerror}") from None


class Job:
    """One run of a :class:`JobConfig`; see :func:`run_job`."""

    def __init__(self, config: JobConfig, note: Callable[[str], None]) -> None:
        self.config = config
        self.note = note
        self.started = time.monotonic()
        self.began = time.time()  # what MPI leaves on the node since then is the job's (mpsrun.session.leftovers)
        self.deadline = Deadline(config.timeout)  # --timeout bounds the whole job, start-up included
        self.local: NodeSession | None = None  # this node's part of the job, when it owns the daemons
        self.accounts: list[RankAccount] = []  # every rank's, once the ranks have ended
        self.usage_file: Path | None = None  # under --hosts, where the job's controller says where its ranks run

    def _elapsed(self, what: str) -> None:
        log.info(f"mpsrun: {what} after {time.monotonic() - self.started:.3f} s")

    def run(self) -> JobResult:
        """Interrupts before the ranks run undo what was made and raise InterruptionError; during teardown they wait.

        The session's directory comes first (the control socket lives there), then, for the mpiexec launcher,
        mpiexec itself (``Backend.head_start``), then the session: the GPUs, the plan and the daemons.
        """
        program = resolve_command(self.config.command)
        make_output_dir(self.config.output_filename)
        backend = choose_backend(self.config)
        if backend.owns_daemons:  # every rank's link comes here (under --hosts, to each host's node keeper)
            ensure_descriptors(self.config.ranks)
        if backend.name == "local" and (self.config.mpiexec or self.config.mpiexec_args):
            log.warning("mpsrun: warning: --mpiexec and --mpiexec-arg have no effect with --launcher local")
        with Interrupts() as interrupts, gpus.nvml_kept():  # NVML, once initialised, kept for the job
            claim = channel = session = None
            try:
                if backend.owns_daemons:
                    gpus.read_ahead()  # by a child, while the directory, the socket and mpiexec's start are made
                # Every job has a record and a reaper (under --hosts for its mpiexec alone: each host's node keeper
                # owns that host's session), so a job killed outright takes what it started along.
                claim = SessionClaim.make(session_base(None), "job", keep_logs=self.config.keep_logs)
                dirs = claim.dirs if backend.owns_daemons else None  # else the ranks come over TCP
                if not backend.owns_daemons and claim.dirs is not None:  # the hosts' ranks, for mpsrun top
                    self.usage_file = claim.dirs.usage_file
                where = f"unix:{dirs.control_socket}" if dirs is not None else \
                    f"tcp:{listen_address(values.host_names(self.config.hosts, self.config.hostfile))}"
                channel = ControlChannel(where,
                                         rendezvous(first_host(self.config), free_port(), os.environ))
                if backend.head_start:
                    self._start_early(backend, program, channel, claim)
                if backend.owns_daemons:
                    self.local = self._node_session()
                session = self.local.session if self.local is not None else None
                failure = self._set_up(session, claim, channel)
                controller = self._run(backend, session, program, channel, interrupts, failure)
            finally:  # from here on a signal is only remembered, NVML's shutdown at the block's end included
                interrupts.defer_to_the_end()
                gpus.drop_read_ahead()
                if channel is not None:
                    channel.close()
                teardown_failure = self._close(session, claim)
        late = interrupts.received[0] if interrupts.received else controller.late_signal
        result = controller.result(teardown_failure, late)
        if late is not None and result.cause == "signal" and not controller.judging.judge.failed:
            self.note(result.message)
        return self._reported(controller, result, teardown_failure, late) if self.config.report else result

    def _reported(self, controller: JobController, result: JobResult, teardown_failure: str,
                  late: int | None) -> JobResult:
        """The job's result once its report is written: a report that could not be written fails the job's end, as a
        teardown that fails does; a signal meanwhile is one while the job ends."""
        with Interrupts(deferred=True) as writing:
            unwritten = self._write_report(controller, result)
        if late is None and writing.received:
            late = writing.received[0]
            result = controller.result(teardown_failure, late)
            if result.cause == "signal" and not controller.judging.judge.failed:
                self.note(result.message)
        return controller.result(unwritten, late) if unwritten and not teardown_failure else result

    def _write_report(self, controller: JobController, result: JobResult) -> str:
        """``--report``: every rank's account and the memory samples; what failed, if the file could not be written."""
        from mpsrun.job.account import Report

        assert self.config.report is not None
        report = Report.of(self.config.command, (result.exit_code, result.cause, result.message), self.began,
                           self.accounts, controller.usage, controller.policy.usage_interval)
        if unwritten := report.save(self.config.report):
            self.note(unwritten)
        return unwritten

    def _start_early(self, backend: Backend, program: str, channel: ControlChannel, claim: SessionClaim | None) -> None:
        """The MPI launcher starts now, while the session comes up (its ranks wait for their welcome)."""
        channel.start_early(backend.specs(self.config, program, channel.env))
        self._elapsed("launcher started")
        if claim is not None and channel.early is not None:  # for the reaper, should we be killed
            claim.add_launcher(channel.early.popen.pid)

    def _node_session(self) -> NodeSession:
        """This node's MPS session, not started yet."""
        from mpsrun.job.nodesession import NodeSession

        return NodeSession(self.config, self.deadline)

    def _set_up(self, session: Session | None, claim: SessionClaim | None,
                channel: ControlChannel) -> MPSError | None:
        """Plan and start the session. A failure is raised, or, with the launcher started ahead, returned: its
        ranks are refused before the failure is reported (:meth:`JobController.abandon`)."""
        if self.local is None:
            _import_the_rest()
            return None
        try:
            self._plan(self.local)
            self._start(self.local, claim)
        except MPSError as exc:  # an interrupt too
            if channel.early is None:
                raise
            return exc
        return None

    def _plan(self, local: NodeSession) -> None:
        """Read the GPUs and plan the ranks on them, refusing what cannot be honoured."""
        from mpsrun.job.placement import ranks_on_gpus
        from mpsrun.job.report import crowding_warnings

        config, session = self.config, local.session
        node = local.plan(config.ranks)
        for line in local.without_mps():
            log.warning(f"mpsrun: {line}")
        plans = node.ranks(config.ranks)
        if session.disabled_reason is None:
            for line in crowding_warnings(ranks_on_gpus(plans) if config.gpu_bind == "single" else {}):
                log.warning(f"mpsrun: {line}")
        for plan in plans:
            log.info(f"mpsrun: rank {plan.rank}: {self._placed(session, plan)}")

    def _placed(self, session: Session, plan: RankPlan) -> str:
        """Where a rank runs and with what limits, for -v."""
        if not session.gpus:
            return "no GPU"
        if session.gpu_bind == "none":
            where = "GPUs " + ",".join(str(g.index) for g in session.gpus)
        else:
            where = f"GPU {session.gpus[plan.gpu].index}"
        auto = " (auto)" if self.config.mem_limit == values.AUTO else ""
        return where + (f", {plan.thread_percentage}% of SMs" if plan.thread_percentage else "") + (
            f", {values.mib_text(plan.mem_limit)} pinned memory{auto}" if plan.mem_limit else "")

    def _start(self, local: NodeSession, claim: SessionClaim | None) -> None:
        assert claim is not None
        local.start("the", claim, _import_the_rest)
        self._elapsed("daemons ready" if local.session.enabled else "set up without MPS")

    def _welcome(self, output_lock: str | None) -> Admit:
        """Each rank's welcome from this node's session. Without one (under --hosts each host's node keeper welcomes
        its ranks; a job that failed to start refuses them first) a rank that says hello here is refused."""
        from mpsrun.job.placement import callers_values

        n, local = self.config.ranks, self.local
        callers = callers_values(os.environ)  # once: the whole environment, gone through for each rank otherwise

        def answer(identity: RankIdentity, hello: Hello) -> Admission:
            if local is None or local.node is None:
                raise MPSError(f"rank {identity.rank} came to the job's controller, not to its node's keeper")
            # One node: what the launcher did not say, the job knows.
            identity = RankIdentity(identity.rank, identity.local_rank, identity.world_size or n,
                                    identity.local_world_size or n)
            return local.admit(identity, output_lock, callers)

        return answer

    def _controller(self, backend: Backend, session: Session | None, channel: ControlChannel) -> JobController:
        """The job's controller, with the launcher started ahead (if any) in its care."""
        from mpsrun.job.jobcontroller import JobController

        config = self.config
        output_lock = None
        if config.tag_output and backend.name == "local" and session is not None and session.dirs is not None:
            session.dirs.output_lock.touch(mode=0o600)
            output_lock = str(session.dirs.output_lock)
        enabled = session is not None and session.enabled
        policy = Policy.for_job(config, self.deadline)
        return JobController(channel.listener, channel.token, self._welcome(output_lock), policy,
                             ranks=config.ranks, session=session, note=self.note, early=channel.hand_over(),
                             server_after=backend.server_after if enabled else None, usage_file=self.usage_file)

    def _run(self, backend: Backend, session: Session | None, program: str, channel: ControlChannel,
             interrupts: Interrupts, failure: MPSError | None) -> JobController:
        config = self.config
        with interrupts.deferred():  # until the controller's loop takes the signals; those meanwhile are pending
            controller = self._controller(backend, None if failure else session, channel)
        pending = list(interrupts.received)  # and a signal a finalizer swallowed
        if failure is not None:
            if isinstance(failure, InterruptionError) and failure.signal in pending:
                pending.remove(failure.signal)  # the interrupt that is the failure: not a second one
            controller.abandon()
            controller.run(pending=pending)
            raise failure

        def start() -> None:  # in the controller's loop, which handles signals from here on
            mps = "on" if controller.watch else "per host" if not backend.owns_daemons else "off"
            log.info(f"mpsrun: {backend.name} launcher, MPS {mps}, {config.ranks} rank(s)")
            controller.launch(backend.specs(config, program, channel.env))
            self._elapsed("ranks starting")

        controller.run(first=start, pending=pending)
        interrupts.defer_to_the_end()  # the ranks are done: a signal from here on comes while the job ends
        self._elapsed("ranks done")
        self._report(controller, session)
        return controller

    def _report(self, controller: JobController, session: Session | None) -> None:
        from mpsrun.job.report import mps_report, verified_line

        if controller.watch is not None:
            controller.settle_watch()
            log.info(f"mpsrun: {verified_line(controller.watch, range(self.config.ranks))}")
        result = controller.result()
        if result.exit_code != ExitCode.OK:
            self.note(result.message)
            rank_of = {s.process.pid: s.rank for s in controller.ranks.values() if s.process is not None}
            for line in (mps_report(session.daemons, rank_of) if session is not None and session.enabled else []):
                self.note(line)
        for line in controller.notes:  # what each host's node keeper had to say (under --hosts)
            self.note(line)
        self._account(controller)

    def _account(self, controller: JobController) -> None:
        """Every rank's account: a table with -v, and one line when their memory peaks and limits are far apart."""
        from mpsrun.job.account import accounted, to_say

        if not accounted(self.config):
            return
        first = controller.judging.judge.first
        self.accounts = controller.accounts(first.rank if first is not None else None)
        table, hints = to_say(self.accounts, self.config)
        for line in table:
            log.info(f"mpsrun: {line}")
        for line in hints:
            self.note(line)

    def _close(self, session: Session | None, claim: SessionClaim | None) -> str:
        """Tear the session down (and its directory, should it never have started); what failed, if anything
        (reported, never hiding the job's outcome)."""
        started = session is not None and session.state not in ("new", "resolved")  # with daemons' logs to keep
        try:
            if session is not None:
                session.close()
            errors = claim.release(None if started else False) if claim is not None else []  # once, whoever first
            if errors:
                raise TeardownError("session teardown failed: " + "; ".join(map(str, errors)), errors=errors)
        except TeardownError as exc:
            self.note(str(exc))
            return str(exc)
        finally:
            _sweep_mpi_leftovers(self.began)
        if claim is not None:
            self._elapsed("torn down")
        return ""


def _sweep_mpi_leftovers(since: float) -> None:
    """What an aborted MPI job left on this node (its launcher has exited by now), said with -v."""
    removed, _ = leftovers.sweep(since)
    if removed:
        log.info(f"mpsrun: removed what MPI left behind: {', '.join(removed)}")


def _stderr_note(text: str) -> None:
    say(f"mpsrun: {text}")


def run_job(config: JobConfig, note: Callable[[str], None] | None = None) -> JobResult:
    """Run a job to completion and return how it ended (exit code, cause, message).

    Raises :class:`ConfigError` (usage, exit 2), :class:`CommandNotFoundError` (127) or
    another :class:`MPSError` (set-up failure, exit 3) before any rank starts.
    """
    return Job(config, note or _stderr_note).run()
