"""Running a job: the ``mpsrun`` command's part. It plans the job, starts its agents, and decides for it.

On one node (``--launcher local`` or ``mpiexec``) the node's agent (:class:`~mpsrun.agent.agent.Agent`) runs in this
process, in the command's loop, and the ranks' supervisors join it (forked here, or started by mpiexec, which starts
ahead while the session comes up). Under ``--hosts`` every host's agent is a node keeper there, reporting here over
TCP (:mod:`mpsrun.job.hosts`). Either way the command decides (:class:`~mpsrun.agent.decision.Decision`): the first
failure across nodes, one stop to all, one summary line, one exit code, the report.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpsrun.agent.decision import Decision
from mpsrun.agent.outcome import JobResult, Policy, RankEnd, ranges
from mpsrun.agent.ranks import turn_away
from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.errors import CommandNotExecutableError, CommandNotFoundError, InterruptionError, MPSError
from mpsrun.exitcodes import Cause, ExitCode, describe_returncode
from mpsrun.job.backends import Backend, choose_backend
from mpsrun.job.launch import Launched, Launchers, LaunchSpec
from mpsrun.mps import gpus
from mpsrun.runtime.constants import (
    ABANDON_WAIT,
    CONTROL_VARIABLE,
    FORWARDED_SIGNALS,
    JOB_ID_VARIABLE,
    KILL_WAIT,
    LAUNCHER_REPORT_WAIT,
    PASS_SIGNALS,
    STOP_SIGNALS,
    TOKEN_VARIABLE,
    USAGE_INTERVAL,
)
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import Interrupts, uninterrupted
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ensure_descriptors, find_program
from mpsrun.runtime.protocol import Ended, Listener, Refusal, Started, new_token
from mpsrun.session import leftovers
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import session_base

if TYPE_CHECKING:  # imported once mpiexec has started ahead, as the daemons start, or only for --hosts
    from mpsrun.agent.account import RankAccount
    from mpsrun.agent.agent import Agent
    from mpsrun.job.hosts import HostAgents

__all__ = ["run_job"]

log = logging.getLogger("mpsrun")


def resolve_command(command: tuple[str, ...]) -> str:
    """The program of a job's command by absolute path; raises as a shell would say it (127, 126)."""
    program, code, reason = find_program(command[0], None)
    if program is None:
        error = CommandNotFoundError if code == ExitCode.NOT_FOUND else CommandNotExecutableError
        raise error(f"{command[0]}: {reason}", command=command[0])
    return program


def make_output_dir(path: str | None) -> None:
    """``--output-filename``'s directory, made here first: one line, not one per rank, when it cannot be made."""
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise MPSError(f"--output-filename {path}: {exc.strerror}") from None


class Job:
    """One run of a :class:`JobConfig`; see :func:`run_job`."""

    def __init__(self, config: JobConfig, note: Callable[[str], None]) -> None:
        self.config, self.note = config, note
        self.started = time.monotonic()
        self.began = time.time()  # what MPI leaves on the node since then is the job's (mpsrun.session.leftovers)
        self.deadline = Deadline(config.timeout)  # --timeout bounds the whole job, start-up included
        self.expected = range(config.ranks)
        self.loop = EventLoop()
        self.token = new_token()  # what every rank's supervisor (or host's agent) shows when it joins
        self.launchers = Launchers(self.loop, self._launcher_exited, self._launch_failed)
        self.decision = Decision(self.loop, stop=self._stop, kill=self._kill, say=note, running=self._running,
                                 started=self._rank_started, ended=self._rank_ended)
        self.agent: Agent | None = None  # this node's, when the job runs here
        self.hosts: HostAgents | None = None  # the hosts' agents, under --hosts
        self.where: dict[int, tuple[str, int]] = {}  # each started rank's host and pid
        self.ends: dict[int, Ended] = {}  # each rank's end, with its account
        self.accounts: list[RankAccount] = []  # every rank's, once the ranks have ended (-v, --report, a limit)
        self.abandoned = False  # the job cannot run: see _abandon()
        self._wound_down = False

    def _elapsed(self, what: str) -> None:
        log.info(f"mpsrun: {what} after {time.monotonic() - self.started:.3f} s")

    def run(self) -> JobResult:
        """Interrupts before the ranks run undo what was made and raise InterruptionError; during teardown they wait.
        The agent's directory comes first (the control socket lives there), then, for the mpiexec launcher, mpiexec
        itself (``Backend.head_start``), then the session: the GPUs, the plan and the daemons."""
        config = self.config
        program = resolve_command(config.command)
        make_output_dir(config.output_filename)
        backend = choose_backend(config)
        if backend.owns_daemons:  # every rank's link comes here (under --hosts, to each host's node keeper)
            ensure_descriptors(config.ranks)
        if backend.name == "local" and (config.mpiexec or config.mpiexec_args):
            log.warning("mpsrun: warning: --mpiexec and --mpiexec-arg have no effect with --launcher local")
        with Interrupts() as interrupts, gpus.nvml_kept():  # NVML, once initialised, kept for the job
            claim: SessionClaim | None = None
            listener: Listener | None = None
            try:
                if backend.owns_daemons:
                    gpus.read_ahead()  # by a child, while the directory, the socket and mpiexec's start are made
                # Every job has a record and a reaper (under --hosts for its mpiexec alone: each host's node keeper
                # owns that host's session), so a job killed outright takes what it started along.
                claim = SessionClaim.make(session_base(None), "job", keep_logs=config.keep_logs)
                listener = self._listen(backend, claim)
                specs = backend.specs(config, program, self._environment(listener))
                if backend.head_start:
                    self._launch_ahead(specs[0], claim.add_launcher)
                self._open(backend, claim, listener)
                listener, claim = None, claim if self.agent is None else None  # the agent's (its session's), else
                self._start(backend, specs, interrupts)  # listener: the hosts' agents'
                self._say_end()
            finally:  # from here on a signal is only remembered, NVML's shutdown at the block's end included
                interrupts.defer_to_the_end()
                gpus.drop_read_ahead()
                teardown = self._close(claim, listener)
        return self._result(teardown, interrupts.received[0] if interrupts.received else self.decision.late_signal)

    def _listen(self, backend: Backend, claim: SessionClaim) -> Listener:
        """Where the ranks join: this node's agent's socket in the session's directory, or under --hosts a TCP port
        the hosts' agents reach, on this host's address toward them."""
        if backend.owns_daemons:
            assert claim.dirs is not None
            return Listener(f"unix:{claim.dirs.control_socket}")
        from mpsrun.job.hosts import listen_address

        hosts = values.host_names(self.config.hosts, self.config.hostfile)
        return Listener(f"tcp:{listen_address(hosts, self.deadline)}")

    def _environment(self, listener: Listener) -> dict[str, str]:
        """What every rank's supervisor starts with: the caller's environment, where to join, the job's token, and
        torch.distributed's rendezvous (rank 0's host: MPI launchers fill hosts in order)."""
        from mpsrun.agent.welcome import free_port, rendezvous

        hosts = values.host_names(self.config.hosts, self.config.hostfile)
        return {**os.environ, **rendezvous(hosts[0] if hosts else "127.0.0.1", free_port(), os.environ),
                CONTROL_VARIABLE: listener.address, TOKEN_VARIABLE: self.token, JOB_ID_VARIABLE: self.token[:16]}

    def _open(self, backend: Backend, claim: SessionClaim, listener: Listener) -> None:
        """This node's agent, given the claim and the listener; or under --hosts the hosts' agents' side here."""
        config = self.config
        if backend.owns_daemons:
            from mpsrun.agent.agent import Agent, Welcoming
            from mpsrun.agent.welcome import callers_values

            self.agent = Agent(config, self.loop, self.decision, claim, listener, self.token, self.deadline,
                               local_size=config.ranks, world_size=config.ranks, server_after=backend.server_after,
                               welcoming=Welcoming(ranks=self.expected, callers=callers_values(os.environ),
                                                   output=(1, 2)))
        else:
            from mpsrun.job.hosts import HostAgents

            assert claim.dirs is not None
            self.hosts = HostAgents(self.loop, listener, self.token, self.decision, claim.dirs.usage_file,
                                    self._hosts_closed)

    def _start(self, backend: Backend, specs: list[LaunchSpec], interrupts: Interrupts) -> None:
        """Start the session, then the ranks (unless mpiexec started ahead), and run the job to its end."""
        failure = None
        try:
            if self.agent is not None:
                self._start_session(self.agent)
        except MPSError as exc:  # an interrupt too
            if not self.launchers.started:
                raise
            failure = exc
        pending = [sig for sig in interrupts.received  # (and a signal a finalizer swallowed), not the failure's own
                   if not (isinstance(failure, InterruptionError) and sig == failure.signal)]
        if failure is not None:
            self._abandon()
            self._run(pending, None)
            raise failure
        policy = Policy.for_job(self.config, self.deadline)
        self.decision.arm(policy.timeout, policy.timeout_total)

        def launch() -> None:  # in the loop, which handles signals from here on
            mps = "on" if self.agent is not None and self.agent.watch else "per host" if self.hosts else "off"
            log.info(f"mpsrun: {backend.name} launcher, MPS {mps}, {self.config.ranks} rank(s)")
            if not self.launchers.started:
                self.launchers.launch(specs)
            self._elapsed("ranks starting")

        self._run(pending, launch)
        interrupts.defer_to_the_end()  # the ranks are done: a signal from here on comes while the job ends
        self._elapsed("ranks done")

    def _launch_ahead(self, spec: LaunchSpec, record: Callable[[int], None]) -> None:
        """The MPI launcher starts now, while the session comes up (its ranks wait for their welcome)."""
        try:
            with uninterrupted():  # a Popen cut short would lose the process
                started = self.launchers.start(spec)
        except OSError as exc:  # as a launcher that cannot start is said in the loop
            raise MPSError(f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}") from None
        self._elapsed("launcher started")
        record(started.popen.pid)

    def _start_session(self, agent: Agent) -> None:
        """Read the GPUs, plan the ranks and start the daemons; say what the plan means."""
        agent.start(meanwhile=_import_the_rest)
        from mpsrun.agent.findings import crowding_warnings, placement_line
        from mpsrun.mps.placement import ranks_on_gpus

        for line in agent.notices():
            log.warning(f"mpsrun: {line}")
        plans = agent.plan.ranks(self.config.ranks) if agent.plan is not None else []
        if agent.session.disabled_reason is None and self.config.gpu_bind == "single":
            for line in crowding_warnings(ranks_on_gpus(plans)):
                log.warning(f"mpsrun: {line}")
        for plan in plans:
            log.info(f"mpsrun: rank {plan.rank}: {placement_line(agent.session, plan)}")
        self._elapsed("daemons ready" if agent.session.enabled else "set up without MPS")

    def _run(self, pending: list[int], first: Callable[[], None] | None) -> None:
        """Run the loop to the job's end; ``pending``: stopping signals that came before it took over."""
        agent = self.agent
        with self.loop.signals(FORWARDED_SIGNALS, self._signalled):
            for sig in pending:
                self.loop.after(0, functools.partial(self._signalled, sig))
            if first is not None:
                self.loop.after(0, lambda: self._guarded(first))
                if agent is not None:
                    agent.run_in()
            with gpus.nvml_kept() if agent and (agent.watch or agent.usage) else contextlib.nullcontext():
                self.loop.run_until(self._done)
        self.loop.close()
        self.launchers.kill_leftovers()

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except MPSError as exc:
            self.decision.fail(Cause.SETUP, exc.exit_code, str(exc))

    def _abandon(self) -> None:
        """The job cannot run (its set-up failed after its MPI launcher had started): every rank supervisor that
        comes is refused quietly with exit 0 (no launcher's banner), the launcher gets --grace (at least
        ABANDON_WAIT, at most what is left of --timeout), then SIGTERM, SIGKILL; a stopping signal kills it."""
        self.abandoned = True
        assert self.agent is not None
        self.agent.abandon()
        wait = max(self.config.grace, ABANDON_WAIT)  # SIGTERM while mpiexec starts ranks makes it print a banner
        self.launchers.wind_down(wait if self.config.timeout is None else min(wait, self.deadline.remaining()))

    # -- the ranks ------------------------------------------------------------------------------------------------

    def _rank_started(self, started: Started) -> None:
        self.where[started.rank] = (started.host, started.pid)

    def _rank_ended(self, ended: Ended) -> None:
        self.ends[ended.rank] = ended
        if self._all_ended():
            self._wind_down()

    def _running(self) -> bool:
        """Whether ranks of the job still run: --timeout bounds them (and the job's start), and the job's own
        teardown after them has deadlines of its own; a job that never ran has its own error."""
        return not self.abandoned and not self._all_ended()

    def _all_ended(self) -> bool:
        return all(rank in self.ends for rank in self.expected)

    def _signalled(self, sig: int) -> None:
        if self.abandoned:  # the job never ran: whatever still starts its refused ranks goes at once
            if sig in STOP_SIGNALS:
                self.launchers.kill()
        elif sig not in PASS_SIGNALS:
            self.decision.signalled(sig)
        elif self.agent is not None:
            self.agent.signal(sig)
        elif self.hosts is not None:
            self.hosts.forward(sig)

    def _stop(self, sig: int, again: bool) -> None:
        """Start nothing more (the ranks still to be launched, and those no launcher was ever started for, will
        never start) and stop the ranks; after --grace the launchers get theirs too."""
        launched = {rank for started in self.launchers.started for rank in started.spec.ranks}
        pending = self.launchers.cancel()
        self._never_started(set(pending) | {rank for rank in self.expected if rank not in launched | set(self.where)})
        if self.agent is not None:
            self.agent.stop(sig, again)
        elif self.hosts is not None:
            judge = self.decision.judge
            self.hosts.stop(sig, judge.exit_code() if judge.failed else None)
            self.loop.after(self.config.grace + KILL_WAIT, self.hosts.give_up)
        self.loop.after(self.config.grace, lambda: self.launchers.wind_down(self.config.grace))

    def _kill(self) -> None:
        """The ranks and whatever still starts them, killed now (a second Ctrl-C)."""
        if self.agent is not None:
            self.agent.signal(signal.SIGKILL)
        elif self.hosts is not None:
            self.hosts.stop(signal.SIGKILL, None)
        self.launchers.kill()

    def _never_started(self, ranks: set[int]) -> None:
        for rank in sorted(ranks - set(self.ends)):
            self._rank_ended(Ended(rank, None, "never started"))
        if self.agent is not None:
            self.agent.never_started(ranks)

    def _wind_down(self) -> None:
        """Every rank has ended: the daemons may quit while the launchers get --grace to exit, once every host's
        agent has closed (its last rank waits for its teardown, which ending the launcher would cut short)."""
        if self._wound_down:
            return
        self._wound_down = True
        if self.agent is not None:
            self.agent.begin_close()
        if self.hosts is None or self.hosts.done:
            self.launchers.wind_down(self.config.grace)
        else:
            self.hosts.close_soon()

    def _hosts_closed(self) -> None:
        """Every host's agent has closed (or is given up): once the ranks are over, the launcher may end."""
        if self._all_ended():
            self.launchers.wind_down(self.config.grace)

    def _done(self) -> bool:
        """Every rank has ended, every launcher has exited, and the hosts' agents have closed (or are late)."""
        if self.abandoned:
            return self.launchers.ended
        return self._all_ended() and self.launchers.ended and (self.hosts is None or self.hosts.done)

    # -- the launchers --------------------------------------------------------------------------------------------

    def _launch_failed(self, spec: LaunchSpec, exc: OSError) -> None:
        """A launcher (a rank's supervisor, or mpiexec) could not be started: the job fails, nothing more starts."""
        self.decision.fail(Cause.SETUP, ExitCode.SETUP, f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}")
        self._never_started({rank for rank in spec.ranks if rank not in self.where})

    def _launcher_exited(self, started: Launched, returncode: int) -> None:
        if self.abandoned:
            return
        self.decision.judge.launcher_ended(started.spec.name, returncode, started.spec.signal_status)
        if self.hosts is not None and any(rank not in self.where for rank in started.spec.ranks):
            # The hosts' agents relay their ranks' starts: those of ranks that ran may still be on their way.
            self.loop.after(LAUNCHER_REPORT_WAIT, lambda: self._launcher_judged(started, returncode, waited=True))
        else:
            self._launcher_judged(started, returncode, waited=False)

    def _launcher_judged(self, started: Launched, returncode: int, waited: bool) -> None:
        name, ranks, fail = started.spec.name, started.spec.ranks, self.decision.fail
        missing = [rank for rank in ranks if rank not in self.where and rank not in self.ends]
        silent = self.hosts.unheard(started.spec.hosts) if self.hosts is not None else []
        if silent and len(missing) == len(ranks):  # no rank started: the launcher did not get there
            fail(Cause.SETUP, ExitCode.SETUP, f"{name} {describe_returncode(returncode)} before any rank started: no "
                 f"node keeper came from {', '.join(silent)}: it could not reach the host or start mpsrun there (its "
                 "own lines say why)")
        elif missing:
            fail(Cause.LAUNCHER_FAILED, returncode, f"{name} {describe_returncode(returncode)} before rank(s) "
                 f"{ranges(missing)} started")
        elif returncode != 0 and self._running_of(started):
            self.loop.after(0 if waited else LAUNCHER_REPORT_WAIT, lambda: self._launcher_outlived(started, returncode))
        self._never_started(set(missing))

    def _running_of(self, started: Launched) -> list[int]:
        return [rank for rank in started.spec.ranks if rank in self.where and rank not in self.ends]

    def _launcher_outlived(self, started: Launched, returncode: int) -> None:
        """The launcher ended while its ranks ran, and their reports have had time to come: what they said decides
        (a lost rank takes the launcher's status as its own), else the launcher's status does."""
        if running := self._running_of(started):
            self.decision.fail(Cause.LAUNCHER_FAILED, returncode, f"{started.spec.name} "
                               f"{describe_returncode(returncode)} while rank(s) {ranges(running)} ran")

    # -- the job's end --------------------------------------------------------------------------------------------

    def _say_end(self) -> None:
        """What the job's end says before its teardown: the proof of MPS (-v), the first failure and what the MPS logs
        tell of it, the hosts' notes, the accounts."""
        from mpsrun.agent.account import RankAccount, accounted, to_say
        from mpsrun.agent.findings import mps_report, verified_line

        judge, agent = self.decision.judge, self.agent
        if agent is not None and agent.watch is not None:
            agent.settle_watch()
            log.info(f"mpsrun: {verified_line(agent.watch, self.expected)}")
        if judge.failed:
            self.note(judge.message)
            rank_of = {pid: rank for rank, (_, pid) in self.where.items()}
            for line in mps_report(agent.session.daemons, rank_of) if agent and agent.session.enabled else []:
                self.note(line)
        for line in self.hosts.notes if self.hosts is not None else []:
            self.note(line)
        if accounted(self.config):
            first = judge.first.rank if judge.first is not None else None
            self.accounts = [RankAccount.of(ended, RankEnd.of(ended, "").what(rank == first))
                             for rank, ended in sorted(self.ends.items())]
            table, hints = to_say(self.accounts, self.config)
            for line in table:
                log.info(f"mpsrun: {line}")
            for line in hints:
                self.note(line)

    def _close(self, claim: SessionClaim | None, listener: Listener | None) -> str:
        """End the session (this node's agent's, or under --hosts the command's own claim); what failed, if anything
        (reported, never hiding the job's outcome). ``listener``: one no agent took (the job failed before)."""
        if listener is not None:  # a launcher's supervisors connected ahead hear the job's end, quietly (exit 0: no
            turn_away(listener, Refusal(ExitCode.OK, ""))  # banner); a word would be a lost controller's
        try:
            if self.hosts is not None:
                self.hosts.close()
            if self.agent is not None:
                self.agent.close()
            elif claim is not None and (errors := claim.release()):
                raise MPSError("session teardown failed: " + "; ".join(map(str, errors)))
        except MPSError as exc:
            self.note(str(exc))
            return str(exc)
        finally:
            removed, _ = leftovers.sweep(self.began)  # what an aborted MPI job left on this node, said with -v
            if removed:
                log.info(f"mpsrun: removed what MPI left behind: {', '.join(removed)}")
        self._elapsed("torn down")
        return ""

    def _result(self, teardown: str, late: int | None) -> JobResult:
        """How the job ended, with a teardown that failed or a signal while it ended; the report written (a signal
        meanwhile is one while the job ends; a report that cannot be written fails the job's end, as a teardown)."""
        judge, unwritten = self.decision.judge, ""
        if self.config.report:
            with Interrupts(deferred=True) as writing:
                unwritten = self._write_report(judge.result(teardown, late))
            late = late if late is not None or not writing.received else writing.received[0]
        result = judge.result(teardown, late)
        if late is not None and result.cause == Cause.SIGNAL and not judge.failed:
            self.note(result.message)
        return judge.result(unwritten, late) if unwritten and not teardown else result

    def _write_report(self, result: JobResult) -> str:
        """``--report``: every rank's account and the memory samples; what failed, if the file could not be written."""
        from mpsrun.agent.account import Report

        assert self.config.report is not None
        usage = self.agent.usage if self.agent is not None else None
        report = Report.of(self.config.command, (result.exit_code, result.cause, result.message), self.began,
                           self.accounts, usage, USAGE_INTERVAL)
        if unwritten := report.save(self.config.report):
            self.note(unwritten)
        return unwritten


def _import_the_rest() -> None:
    """What only a running job needs, imported while the daemons come up."""
    from mpsrun.agent.agent import AFTER_START

    for name in (*AFTER_START, "mpsrun.rank.forked"):
        importlib.import_module(name)


def _stderr_note(text: str) -> None:
    say(f"mpsrun: {text}")


def run_job(config: JobConfig, note: Callable[[str], None] | None = None) -> JobResult:
    """Run a job to completion and return how it ended (exit code, cause, message).

    Raises :class:`ConfigError` (usage, exit 2), :class:`CommandNotFoundError` (127) or
    another :class:`MPSError` (set-up failure, exit 3) before any rank starts.
    """
    return Job(config, note or _stderr_note).run()
