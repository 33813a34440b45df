"""The controller: one job contract, applied to ranks wherever and however they were started.

Rank supervisors (and, for jobs over several hosts, node keepers relaying for theirs) join
through :class:`~mpsrun.job.table.RankTable`. The controller welcomes each rank with its
environment, watches that the ranks are MPS clients, and applies fail-fast to every path
alike: at the first failure, ``terminate_client`` for connected ranks, SIGTERM, ``--grace``,
SIGKILL, then the launcher processes. The first failure decides the exit code (128+N for a
signal) and the summary. A controller with an ``upstream`` (a node keeper under a
multi-host job) relays events up and carries out what comes down instead of judging.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode, describe_returncode, exit_code_of, signal_name
from mpsrun.job import policy as rules
from mpsrun.job.backends import Launched, Launchers, LaunchSpec
from mpsrun.job.outcome import JobResult, Judge, RankEnd, ranges
from mpsrun.job.policy import Policy, Welcome
from mpsrun.job.table import RankState, RankTable
from mpsrun.mps.watch import Finding, RankWatch, with_descendants
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.loop import EventLoop, Timer
from mpsrun.runtime.protocol import Link, Listener
from mpsrun.session.session import Session

__all__ = ["Controller", "Policy"]

class Controller:
    """``expected``: the job's ranks (None for a node keeper: whoever joins). ``session``: the MPS
    session of this host's ranks, if this controller owns one (for the client watch and detaching)."""

    def __init__(self, listener: Listener, token: str, welcome: Welcome, policy: Policy, *,
                 expected: Iterable[int] | None, session: Session | None = None, upstream: Link | None = None,
                 note: Callable[[str], None] = print) -> None:
        self.welcome, self.policy, self.session, self.upstream, self.note = welcome, policy, session, upstream, note
        self.expected = None if expected is None else set(expected)
        self.loop = EventLoop()
        self.table = RankTable(self.loop, listener, token, self, socket.gethostname())
        self.launchers = Launchers(self.loop, self._launcher_exited, self._launch_failed)
        self.watch = RankWatch(session.watcher(), policy.mps_required) \
            if session is not None and session.enabled else None
        self.judge = Judge()
        self.notes: list[str] = []  # lines for the end of the job (from node keepers)
        self.stopping: int | None = None
        self.interrupted_by: int | None = None
        self.report_in_verdicts = False  # a node keeper without upstream: its ranks print the summary
        self.before_last_verdict: Callable[[], list[str]] | None = None
        self.expected_count: int | None = None  # a node keeper: how many ranks the launcher put on the node
        self.give_up = False  # a node keeper that no rank ever joined, or that waited for late ranks in vain
        self.abandoned = False  # the job cannot run: see abandon()
        self.first_started: Callable[[], object] | None = None  # called as the first rank starts
        self._kill_timer: Timer | None = None
        self._summary_pending = self._detached = self._nodes_timer = self._nodes_overdue = False
        self._interrupts: dict[int, float] = {}  # source -> when its first interrupt came
        self._refusals: set[str] = set()  # refusals already said

    @property
    def ranks(self) -> dict[int, RankState]:
        return self.table.ranks

    def run(self, first: Callable[[], object] | None = None, pending: Sequence[int] = ()) -> JobResult:
        """Run the job to its end; ``first`` runs once the loop handles signals (it may raise MPSError).

        ``pending``: stopping signals that arrived before the loop took over (acted on first).
        """
        with self.loop.signals((*rules.STOP_SIGNALS, *rules.FORWARD_SIGNALS), self._on_signal):
            if self.upstream is not None:
                self.loop.watch(upstream_fd := self.upstream.fileno(), lambda: self._on_upstream(upstream_fd))
            elif self.policy.timeout is not None:
                self.loop.after(self.policy.timeout, self._timed_out)
            if self.watch is not None:
                self.loop.after(self.policy.watch_interval, self._check)
            for sig in pending:
                self.loop.after(0, functools.partial(self._on_signal, sig))
            if first is not None:
                self.loop.after(0, lambda: self._guarded(first))
            with self.watch.held() if self.watch is not None else contextlib.nullcontext():
                self.loop.run_until(self._done)
        self.loop.close()
        return self.judge.result([s.end for s in self.ranks.values() if s.end is not None])

    def settle_watch(self) -> None:
        """Let the client watch read the daemons' logs once more, knowing every rank that ran."""
        if self.watch is not None:
            self.watch.settle({s.process.pid: s.rank for s in self.ranks.values() if s.process is not None})

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except MPSError as exc:
            self.fail("setup", exc.exit_code, str(exc))

    def _launch_failed(self, spec: LaunchSpec, exc: OSError) -> None:
        """A launcher (a rank's supervisor, or mpiexec) could not be started: the job fails, nothing more starts."""
        self.fail("setup", ExitCode.SETUP, f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}")
        self._never_started([r for r in spec.ranks if r not in self.ranks])

    def _never_started(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            self.ranks[rank] = RankState(rank, end=RankEnd(rank, None, None, "never started"), verdict_sent=True)

    def _done(self) -> bool:
        if self.give_up:
            return True
        if self.expected is not None:  # and the hosts' node keepers have closed their sessions (or are overdue)
            return self.table.ended(self.expected) and self.launchers.ended and (
                not self.table.nodes or self._nodes_overdue)
        every = len(self.ranks) >= (self.expected_count or 1)
        return every and all(s.end is not None and s.verdict_sent for s in self.ranks.values())

    # -- what the ranks say (mpsrun.job.table.RankEvents) ---------------------------------------------

    def admit(self, link: Link, identity: RankIdentity, hello: Mapping[str, Any]) -> None:
        """Welcome a rank with its environment, or refuse it (the refusal is then its end)."""
        rank, known = identity.rank, self.ranks.get(identity.rank)
        refusal: tuple[int, str] | None = None
        if known is not None:
            refusal = (ExitCode.SETUP, f"rank {rank} is already part of this job")
        elif self.expected is not None and rank not in self.expected:
            refusal = (ExitCode.SETUP, f"rank {rank} is not part of this job (ranks {ranges(sorted(self.expected))})")
        elif self.stopping is not None:
            refusal = (0 if self.abandoned else self.judge.exit_code(), "")
        if refusal is None:
            try:
                link.send("welcome", **self.welcome(identity, hello))
                self.ranks[rank] = RankState(rank, link)
                return
            except MPSError as exc:
                refusal = (exc.exit_code, f"mpsrun: error: {exc}")
        link.send("refuse", exit_code=refusal[0], message=self._once(*refusal))
        self.table.close(link)
        if known is None:  # the refusal is its verdict; its end may still be the node's last
            state = self.ranks[rank] = RankState(rank, link)
            self.rank_ended(state, RankEnd(rank, None, refusal[0], refusal[1].removeprefix("mpsrun: error: ")))

    def _once(self, code: int, refusal: str) -> str:
        """A refusal is said once: by the first rank refused for it, or under --hosts by the job's controller."""
        if not refusal or refusal in self._refusals:
            return ""
        self._refusals.add(refusal)
        if self.upstream is not None:
            self.upstream.send("finding", message=refusal.removeprefix("mpsrun: error: "), fatal=True, code=code)
            return ""
        return refusal

    def rank_started(self, state: RankState, message: Mapping[str, Any]) -> None:
        if self.first_started is not None:
            first, self.first_started = self.first_started, None
            first()
        if state.process is not None and self.session is not None:
            self.session.add_rank(state.process)
        if self.upstream is not None:
            self.upstream.send("started", **{**message, "rank": state.rank})
        if self.stopping is not None:  # started while the job was already stopping
            self._signal(self.stopping, [state])

    def rank_ended(self, state: RankState, end: RankEnd) -> None:
        if end.returncode != 0 and self.watch is not None and self.stopping is None:
            for finding in self.watch.dead_daemons():  # the rank failed because its server went away
                self._finding(finding)
        state.end = end
        if self.upstream is not None:
            self.upstream.send("exited", rank=end.rank, pid=end.pid, returncode=end.returncode, reason=end.reason)
            if not self.table.live():  # the job's controller answers at once; should it not, the node must close
                self.loop.after(rules.VERDICT_WAIT, self._verdicts_overdue)
            return
        if self.judge.rank_ended(end):
            self._summary_pending = True
            self.stop(signal.SIGTERM)
        self._verdict(state)
        if self.expected is not None and self.table.ended(self.expected):
            self._wind_down()

    def _wind_down(self) -> None:
        """Every rank has ended: the launchers get --grace to exit, once every host's node keeper has closed
        (a keeper's last rank waits for its teardown, and ending the launcher would cut that short)."""
        if self.session is not None:  # no client is left (nor to detach): the daemons quit while the launchers exit
            self._detached = True
            self.session.begin_close()
        if not self.table.nodes:
            self.launchers.wind_down(self.policy.grace)
        elif not self._nodes_timer:
            self._nodes_timer = True
            self.loop.after(rules.NODE_CLOSE_WAIT, self._nodes_late)

    def _nodes_late(self) -> None:
        self._nodes_overdue = True
        self.launchers.wind_down(self.policy.grace)

    def node_closed(self) -> None:
        if self.expected is not None and self.table.ended(self.expected):
            self._wind_down()

    def interrupted(self, sig: int, source: int) -> None:
        """A rank's supervisor (or a node keeper) got a stopping signal from outside: the job was interrupted.

        srun and mpiexec send one to every rank, so one from each ``source`` (a connection) is one
        interrupt; a SIGINT from the same source again, later than a terminal and a launcher
        would deliver the same Ctrl-C twice, is the user's second Ctrl-C: kill at once.
        """
        now = time.monotonic()
        first = self._interrupts.setdefault(source, now)
        if self.interrupted_by is None or (sig == signal.SIGINT and now - first > rules.SAME_INTERRUPT):
            self._on_signal(sig)

    def relayed(self, kind: str, message: Mapping[str, Any]) -> None:
        if kind == "note":
            self.notes.append(str(message.get("text")))
            return
        self._finding(Finding(str(message.get("message")), bool(message.get("fatal"))))
        if isinstance(message.get("code"), int) and self.judge.cause == "check-failed":
            self.judge.code = message["code"]

    # -- decisions --------------------------------------------------------------------------------

    def _verdict(self, state: RankState, code: int | None = None, lines: Sequence[str] = ()) -> None:
        if state.verdict_sent:
            return
        state.verdict_sent = True
        if code is None:
            own = exit_code_of(state.end.returncode) if state.end and state.end.returncode is not None else 0
            code = self.judge.exit_code() if self.judge.failed else own
        lines = list(lines)
        if self.report_in_verdicts and self._summary_pending and state.link is not None and state.link.usable:
            lines.insert(0, self.judge.message)
            self._summary_pending = False
        closing = self.before_last_verdict
        last = closing is not None and all(s.verdict_sent for s in self.ranks.values())
        if closing is not None and last and len(self.ranks) < (self.expected_count or 0):
            last = False  # a rank of the node has yet to come: keep the session for it a while
            self.loop.after(rules.LATE_WAIT, self._late_ranks_overdue)
        if closing is not None and last:
            lines += closing()  # the last rank out waits for the node's teardown
        if state.link is not None:  # ... and, with linger, for this process to end
            state.link.send("verdict", rank=state.rank, exit_code=code, lines=lines, linger=last)

    def fail(self, cause: str, code: int, message: str) -> None:
        """Fail the job for a reason of its own (unless something failed first) and stop the ranks."""
        if self.upstream is not None:
            self.upstream.send("finding", message=message, fatal=True, code=code)
        elif self.judge.decide(cause, code, message):
            self._summary_pending = True
        self.stop(signal.SIGTERM)

    def abandon(self) -> None:
        """The job cannot run (its set-up failed after its MPI launcher had started): every rank supervisor that
        comes is refused quietly with exit 0 (no launcher's banner), the launcher gets --grace (at least 5 s, at
        most what is left of --timeout), then SIGTERM, SIGKILL; a stopping signal kills it. Its caller reports."""
        self.abandoned = True
        self.stop(signal.SIGTERM)
        wait = max(self.policy.grace, rules.ABANDON_WAIT)  # SIGTERM while mpiexec starts ranks makes it print a banner
        self.launchers.wind_down(wait if self.policy.timeout is None else min(wait, max(self.policy.timeout, 0.0)))

    def stop(self, sig: int, restart: bool = False) -> None:
        """Start no more ranks; detach connected ranks from MPS, send ``sig`` to every rank; SIGKILL after --grace."""
        if self.stopping is not None and not restart:
            return
        self.stopping = sig
        self._never_started(self.launchers.cancel())
        self._detach_once()
        self._signal(sig, self.table.live())
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._kill_timer = self.loop.after(self.policy.grace, self._kill)

    def _kill(self) -> None:
        """``--grace`` is over: SIGKILL; a rank that still does not report is given up as lost, and an MPI launcher
        still starting ranks (or hung before them) gets --grace more, then SIGTERM, then SIGKILL."""
        self._signal(signal.SIGKILL, self.table.live())
        self.loop.after(rules.KILL_WAIT, self._lost)
        self.launchers.wind_down(self.policy.grace)

    def _lost(self) -> None:
        for state in self.table.live():
            pid = state.process.pid if state.process is not None else None
            self.rank_ended(state, RankEnd(state.rank, pid, None, "no word from it after SIGKILL"))

    def _detach_once(self) -> None:
        if self.watch is None or self.session is None or self._detached:
            return
        self._detached = True
        try:
            self.session.detach_clients(list(with_descendants(self.table.local_pids())))
        except MPSError as exc:  # stopping must go on
            self.note(f"could not detach ranks from MPS before stopping them: {exc}")

    def _signal(self, sig: int, states: Iterable[RankState]) -> None:
        by_link: dict[Link, list[int]] = {}
        for state in states:
            if state.end is not None:
                continue
            if state.link is not None and state.link.usable:
                by_link.setdefault(state.link, []).append(state.rank)
            elif state.process is not None:
                state.process.signal_group(sig)
        for link, ranks in by_link.items():
            link.send("signal", signal=sig, ranks=ranks)

    # -- events -----------------------------------------------------------------------------------

    def _on_signal(self, sig: int) -> None:
        if self.abandoned:
            if sig in rules.STOP_SIGNALS:
                self.launchers.kill()
            return
        if sig in rules.FORWARD_SIGNALS:
            self._signal(sig, self.table.live())
        elif self.upstream is not None:  # the job's controller decides; the ranks here get the signal now
            self.interrupted_by = self.interrupted_by or sig
            self.upstream.send("interrupted", signal=sig)
            self._signal(sig, self.table.live())
        elif self.interrupted_by is not None and sig == signal.SIGINT:
            self.note("second interrupt: killing the ranks now")
            self._signal(signal.SIGKILL, self.table.live())
            self.launchers.kill()  # and the MPI launcher, which may still be starting ranks
        elif self.interrupted_by is None:
            self.interrupted_by = sig
            self.note(f"received {signal_name(sig)}; stopping the ranks")
            if self.judge.decide("signal", 128 + sig, f"stopped by {signal_name(sig)}"):
                self._summary_pending = True
            self.stop(sig, restart=True)

    def _timed_out(self) -> None:
        if self.abandoned:  # the job never ran: its own error is the one to report
            return
        timeout = self.policy.timeout_total or self.policy.timeout
        self.note(f"timeout: the job ran longer than {timeout:g} s; stopping it")
        if self.judge.decide("timeout", ExitCode.TIMEOUT, f"timed out after {timeout:g} s"):
            self._summary_pending = True
        self.stop(signal.SIGTERM)

    def _check(self) -> None:
        if self.watch is None or self.stopping is not None or self._detached or not self.table.accepting:
            return
        for finding in self.watch.check(self.table.local_pids()):
            self._finding(finding)
        self.loop.after(self.policy.watch_interval, self._check)

    def _finding(self, finding: Finding) -> None:
        if finding.fatal:
            self.fail("check-failed", ExitCode.SETUP, finding.message)
        elif self.upstream is not None:
            self.upstream.send("finding", message=finding.message, fatal=False)
        else:
            self.note(f"warning: {finding.message}")

    def _launcher_exited(self, started: Launched, returncode: int) -> None:
        name = started.spec.name
        self.judge.launcher_ended(name, returncode)
        missing = [r for r in started.spec.ranks if r not in self.ranks]
        running = [self.ranks[r] for r in started.spec.ranks if r in self.ranks and self.ranks[r].end is None]
        if missing:
            code = exit_code_of(returncode) or ExitCode.SETUP
            self.fail("launcher-failed", code, f"{name} {describe_returncode(returncode)} before rank(s) "
                      f"{ranges(missing)} started")
            self._never_started(missing)
        elif returncode != 0 and running:
            self.fail("launcher-failed", exit_code_of(returncode),
                      f"{name} {describe_returncode(returncode)} while rank(s) {ranges([s.rank for s in running])} ran")

    # -- upstream (a node keeper in a multi-host job) ---------------------------------------------

    def _late_ranks_overdue(self) -> None:
        if self.before_last_verdict is not None and all(s.verdict_sent for s in self.ranks.values()):
            self.before_last_verdict()
            self.give_up = True

    def _verdicts_overdue(self) -> None:
        for state in self.ranks.values():
            if state.end is not None and not state.verdict_sent:
                self._verdict(state)

    def _on_upstream(self, fd: int) -> None:
        assert self.upstream is not None
        messages = self.upstream.receive()
        if messages is None:
            self.loop.unwatch(fd)  # before the close: see Link
            self.upstream.close()
            self.upstream = None
            self.fail("setup", ExitCode.SETUP, "lost the job's controller")
            self._verdicts_overdue()
            return
        for message in messages:
            ranks = message.get("ranks")
            chosen = [s for s in self.ranks.values() if not isinstance(ranks, list) or s.rank in ranks]
            if message.get("type") == "signal" and isinstance(message.get("signal"), int):
                if message["signal"] in rules.STOP_SIGNALS:
                    self._detach_once()
                self._signal(message["signal"], chosen)
            elif message.get("type") == "verdict" and message.get("rank") in self.ranks:
                self._verdict(self.ranks[message["rank"]], message.get("exit_code"), message.get("lines") or ())
