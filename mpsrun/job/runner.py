"""Running a job: check and plan everything, start the session, start the ranks, judge, report, tear down.

The CLI builds a :class:`~mpsrun.config.options.JobConfig` and calls :func:`run_job`; nothing here
parses command lines or exits the interpreter. Every backend goes through the same steps;
only what the backend starts differs (:mod:`mpsrun.job.backends`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mpsrun.config.options import JobConfig
from mpsrun.errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    ConfigError,
    DaemonError,
    DaemonTimeoutError,
    JobTimeoutError,
    MPSError,
    TeardownError,
)
from mpsrun.exitcodes import ExitCode, signal_name
from mpsrun.job.backends import Backend, choose_backend
from mpsrun.job.control import JobControl
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import InterruptionError, Interrupts
from mpsrun.runtime.logs import Log
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import find_program
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import session_base

if TYPE_CHECKING:  # the modules of the session and the plan are imported once mpiexec has started (Job.run)
    from mpsrun.job.controller import Controller
    from mpsrun.job.outcome import JobResult
    from mpsrun.job.placement import RankPlan
    from mpsrun.mps.watch import RankWatch
    from mpsrun.session.session import Session

__all__ = ["run_job"]

log = Log("mpsrun")


def _import_the_launch() -> None:
    """Import what starting the ranks takes (about 12 ms on the H100) while the daemons come up (25 ms)."""
    from mpsrun.rank import forked  # noqa: F401


def resolve_command(command: tuple[str, ...]) -> str:
    """The program of a job's command by absolute path; raises as a shell would say it (127, 126)."""
    program, code, reason = find_program(command[0], None)
    if program is None:
        error = CommandNotFoundError if code == ExitCode.NOT_FOUND else CommandNotExecutableError
        raise error(f"{command[0]}: {reason}", command=command[0])
    return program


class Job:
    """One run of a :class:`JobConfig`; see :func:`run_job`."""

    def __init__(self, config: JobConfig, note: Callable[[str], None]) -> None:
        self.config = config
        self.note = note
        self.started = time.monotonic()
        self.deadline = Deadline(config.timeout)  # --timeout bounds the whole job, start-up included

    def _elapsed(self, what: str) -> None:
        log.info(f"mpsrun: {what} after {time.monotonic() - self.started:.3f} s")

    def _check(self, backend: Backend) -> None:
        config = self.config
        if isinstance(config.thread_percentage, tuple) and len(config.thread_percentage) != config.ranks:
            raise ConfigError(f"--thread-percentage lists {len(config.thread_percentage)} values but there are "
                              f"{config.ranks} ranks; give one value per rank, a single value, or auto",
                              setting="--thread-percentage")
        if backend.name == "local" and (config.mpiexec or config.mpiexec_args):
            log.warning("mpsrun: warning: --mpiexec and --mpiexec-arg have no effect with --launcher local")

    def _new_session(self) -> Session:
        """The job's MPS session, not started yet."""
        from mpsrun.session.session import START_TIMEOUT, Session

        config = self.config
        return Session(gpus=list(config.gpus) if config.gpus is not None else "all", mps=config.mps,
                       keep_logs=config.keep_logs, export=False, quiet=True, gpu_bind=config.gpu_bind,
                       start_timeout=max(0.1, self.deadline.cap(START_TIMEOUT)))

    def _plan(self, session: Session) -> None:
        """Read the GPUs, plan the ranks on them, and give the daemons the plans' defaults."""
        from mpsrun.job.placement import plan_job, ranks_on_gpus, without_mps
        from mpsrun.job.report import crowding_warnings

        config = self.config
        session.resolve()
        if session.disabled_reason is not None:
            for line in without_mps(config, session.disabled_reason):
                log.warning(f"mpsrun: {line}")
        plans = plan_job(config.ranks, len(session.gpus), config, session.free_memory())
        if session.disabled_reason is None:
            for line in crowding_warnings(ranks_on_gpus(plans) if config.gpu_bind == "single" else {}):
                log.warning(f"mpsrun: {line}")
        for plan in plans:
            log.info(f"mpsrun: rank {plan.rank}: {self._placed(session, plan)}")
        percentages = {p.thread_percentage for p in plans}
        cap = max(p for p in percentages if p is not None) if None not in percentages else None
        by_gpu = {plan.gpu: plan.mem_limit for plan in plans}  # every rank on a GPU has the same limit
        session.set_defaults(cap, [by_gpu.get(p) for p in range(len(session.gpus))])  # the daemons' defaults

    def _placed(self, session: Session, plan: RankPlan) -> str:
        """Where a rank runs and with what limits, for -v."""
        if session.gpu_bind == "none":
            where = "GPUs " + ",".join(str(g.index) for g in session.gpus)
        else:
            where = f"GPU {session.gpus[plan.gpu].index if session.gpus else '-'}"
        return where + (f", {plan.thread_percentage}% of SMs" if plan.thread_percentage else "") + (
            f", {plan.mem_limit} pinned memory" + (" (auto)" if self.config.mem_limit == "auto" else "")
            if plan.mem_limit else "")

    def _welcome(self, session: Session | None, output_lock: str | None) -> Callable[..., dict[str, Any]]:
        from mpsrun.job.placement import welcome

        n = self.config.ranks

        def answer(identity: RankIdentity, hello: Mapping[str, Any]) -> dict[str, Any]:
            # One node: what the launcher did not say, the job knows.
            identity = RankIdentity(identity.rank, identity.local_rank, identity.world_size or n,
                                    identity.local_world_size or n)
            gpus = len(session.gpus) if session else 0
            return welcome(identity, self.config, gpus, session.target if session else lambda _: None, output_lock,
                           session.free_memory() if session else (),
                           str(session.dirs.root) if session and session.dirs else None)

        return answer

    def run(self) -> JobResult:
        """Interrupts before the ranks run undo what was made and raise Interrupted; during teardown they wait.

        The session's directory comes first (the control socket lives there), then, for the mpiexec launcher,
        mpiexec itself (``Backend.head_start``), then the session: the GPUs, the plan and the daemons.
        """
        program = resolve_command(self.config.command)
        backend = choose_backend(self.config)
        self._check(backend)
        with Interrupts() as interrupts, contextlib.ExitStack() as nvml:
            claim = control = session = None
            try:
                if backend.owns_daemons:
                    claim = SessionClaim(session_base(None), "job", keep_logs=self.config.keep_logs)
                control = JobControl(f"unix:{claim.dirs.control_socket}" if claim and claim.dirs else "tcp")
                if backend.head_start:
                    control.start_early(backend.specs(self.config, program, control.env))
                    self._elapsed("launcher started")
                    if claim is not None and control.early is not None:  # for the reaper, should we be killed
                        claim.add_launcher(control.early.popen.pid)
                from mpsrun.mps import gpus  # after mpiexec's start: its dataclasses cost 3-4 ms

                nvml.enter_context(gpus.nvml_kept())  # NVML, once initialised, kept for the job
                session = self._new_session() if claim else None
                failure = self._set_up(session, claim, control)
                result = self._run(backend, session, program, control, interrupts, failure)
            finally:
                with interrupts.deferred():
                    if control is not None:
                        control.close()
                    teardown_failure = self._close(session, claim)
        return self._with_teardown(result, teardown_failure, interrupts.received)

    def _set_up(self, session: Session | None, claim: SessionClaim | None, control: JobControl) -> MPSError | None:
        """Plan and start the session. A failure is raised, or, with the launcher started ahead, returned: its
        ranks are refused before the failure is reported (:meth:`Controller.abandon`)."""
        if session is None:
            return None
        try:
            self._plan(session)
            self._start(session, claim)
        except MPSError as exc:  # an interrupt too
            if control.early is None:
                raise
            return exc
        return None

    def _start(self, session: Session, claim: SessionClaim | None) -> None:
        try:
            session.start(kind="job", meanwhile=_import_the_launch, claim=claim)
        except DaemonTimeoutError as exc:
            if self.deadline.expired():
                raise JobTimeoutError(f"timed out after {self.config.timeout:g} s while the MPS daemons started "
                                      f"({exc})", timeout=self.config.timeout or 0.0) from None
            raise
        self._elapsed("daemons ready")

    def _controller(self, backend: Backend, session: Session | None, control: JobControl) -> Controller:
        """The job's controller, with the launcher started ahead (if any) in its care."""
        from mpsrun.job.controller import Controller, Policy

        config = self.config
        output_lock = None
        if config.tag_output and backend.name == "local" and session is not None and session.dirs is not None:
            session.dirs.output_lock.touch(mode=0o600)
            output_lock = str(session.dirs.output_lock)
        policy = Policy(grace=config.grace, timeout=self.deadline.remaining() if config.timeout else None,
                        timeout_total=config.timeout, mps_required=config.mps == "on")
        controller = Controller(control.listener, control.token, self._welcome(session, output_lock), policy,
                                expected=range(config.ranks), session=session, note=self.note)
        early = control.hand_over()
        if early is not None:
            controller.launchers.adopt(early)
        return controller

    def _run(self, backend: Backend, session: Session | None, program: str, control: JobControl,
             interrupts: Interrupts, failure: MPSError | None) -> JobResult:
        config = self.config
        with interrupts.deferred():  # until the controller's loop takes the signals; those meanwhile are pending
            controller = self._controller(backend, None if failure else session, control)
        pending = list(interrupts.received)  # and a signal a finalizer swallowed
        if failure is not None:
            if isinstance(failure, InterruptionError) and failure.signal in pending:
                pending.remove(failure.signal)  # the interrupt that is the failure: not a second one
            controller.abandon()
            controller.run(pending=pending)
            raise failure
        watch = controller.watch

        def start() -> None:  # in the controller's loop, which handles signals from here on
            mps = "on" if watch else "per host" if not backend.owns_daemons else "off"
            log.info(f"mpsrun: {backend.name} launcher, MPS {mps}, {config.ranks} rank(s)")
            if not controller.launchers.started:
                controller.launchers.launch(backend.specs(config, program, control.env))
            self._elapsed("ranks starting")
            if watch is not None and backend.server_after is not None:
                after = backend.server_after
                controller.first_started = lambda: controller.loop.after(after, lambda: self._ask_servers(controller,
                                                                                                       session))

        result = controller.run(first=start, pending=pending)
        self._elapsed("ranks done")
        self._report(result, controller, session, watch)
        return result

    def _with_teardown(self, result: JobResult, failure: str, received: list[int]) -> JobResult:
        from mpsrun.job.outcome import JobResult

        if failure and result.exit_code == ExitCode.OK:
            return JobResult(ExitCode.SETUP, "teardown-failed", failure)
        if received and result.exit_code == ExitCode.OK:
            sig = received[0]
            result = JobResult(128 + sig, "signal", f"interrupted by {signal_name(sig)} while ending the job")
            self.note(result.message)
        return result

    def _ask_servers(self, controller: Controller, session: Session | None) -> None:
        """Start each server before its first client needs it (Backend.server_after), unless the job is stopping or
        over: once every rank has ended the daemons may be quitting already."""
        if session is None or controller.stopping is not None or controller.table.ended(range(self.config.ranks)):
            return
        for daemon in session.daemons:
            try:
                daemon.start_server(wait=False)
            except DaemonError as exc:  # the watch reports a daemon that died
                log.debug("mpsrun: could not ask for an MPS server: %s", exc)

    def _report(self, result: JobResult, controller: Controller, session: Session | None,
                watch: RankWatch | None) -> None:
        from mpsrun.job.report import mps_report, verified_line

        if watch is not None:
            controller.settle_watch()
            log.info(f"mpsrun: {verified_line(watch, range(self.config.ranks))}")
        if result.exit_code != ExitCode.OK:
            self.note(result.message)
            rank_of = {s.process.pid: s.rank for s in controller.ranks.values() if s.process is not None}
            for line in (mps_report(session.daemons, rank_of) if session is not None and session.enabled else []):
                self.note(line)
        for line in controller.notes:  # what each host's node keeper had to say (under --hosts)
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
        if claim is not None:
            self._elapsed("torn down")
        return ""


def _stderr_note(text: str) -> None:
    say(f"mpsrun: {text}")


def run_job(config: JobConfig, note: Callable[[str], None] | None = None) -> JobResult:
    """Run a job to completion and return how it ended (exit code, cause, message).

    Raises :class:`ConfigError` (usage, exit 2), :class:`CommandNotFoundError` (127) or
    another :class:`MPSError` (set-up failure, exit 3) before any rank starts.
    """
    return Job(config, note or _stderr_note).run()
