"""The controller: one job contract, applied to ranks wherever and however they were started.

Rank supervisors (and, for jobs over several hosts, node keepers relaying for theirs)
connect to the controller's socket. The controller welcomes each rank with its
environment, watches that the ranks are MPS clients, and applies fail-fast to every path
alike: at the first failure, ``terminate_client`` for connected ranks, SIGTERM, ``--grace``,
SIGKILL, then the launcher processes. The first failure decides the exit code (128+N for a
signal) and the summary. A controller with an ``upstream`` (a node keeper under a
multi-host job) relays events up and carries out what comes down instead of judging.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from mpsrun.backends import Launched, LaunchSpec
from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode, describe_returncode, exit_code_of, signal_name
from mpsrun.launchers import RankIdentity
from mpsrun.loop import EventLoop
from mpsrun.outcome import JobResult, Judge, RankEnd, ranges
from mpsrun.procs import ProcessRef, kill_group
from mpsrun.protocol import Link, Listener, token_matches
from mpsrun.session import Session
from mpsrun.watch import ClientWatcher, Finding, RankWatch, with_descendants

__all__ = ["Controller", "Policy", "RankState"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
Welcome = Callable[[RankIdentity, Mapping[str, Any]], dict[str, Any]]


@attrs.frozen
class Policy:
    grace: float = 5.0
    timeout: float | None = None
    mps_required: bool = False  # --mps on: a rank found without MPS fails the job
    watch_interval: tuple[float, float] = (0.2, 2.0)


@attrs.define(eq=False)
class RankState:
    rank: int
    link: Link | None = None
    process: ProcessRef | None = None  # set when the rank runs on this host
    end: RankEnd | None = None
    verdict_sent: bool = False


class Controller:
    """``expected``: the job's ranks (None for a node keeper: whoever joins). ``session``: the MPS
    session of this host's ranks, if this controller owns one (for the client watch and detaching)."""

    def __init__(self, listener: Listener, token: str, welcome: Welcome, policy: Policy, *,
                 expected: Iterable[int] | None, session: Session | None = None, upstream: Link | None = None,
                 note: Callable[[str], None] = print) -> None:
        self.listener, self.token, self.welcome, self.policy = listener, token, welcome, policy
        self.expected = None if expected is None else set(expected)
        self.session, self.upstream, self.note = session, upstream, note
        self.watch = RankWatch(ClientWatcher(session.gpus, session.daemons), policy.mps_required) \
            if session is not None and session.enabled else None
        self.loop = EventLoop()
        self.judge = Judge()
        self.ranks: dict[int, RankState] = {}
        self.launched: list[Launched] = []
        self.notes: list[str] = []  # lines for the end of the job (from node keepers)
        self.stopping: int | None = None
        self.interrupted: int | None = None
        self.host = socket.gethostname()
        self.report_in_verdicts = False  # a node keeper without upstream: its ranks print the summary
        self.accepting = True  # False while a node keeper closes: a rank that comes now starts a new one
        self.give_up = False  # a node keeper that no rank ever joined
        self.before_last_verdict: Callable[[], list[str]] | None = None
        self._kill_timer: Any = None
        self._watch_every = policy.watch_interval[0]
        self._summary_pending = False
        self._winding_down = False
        self._detached = False
        self._upstream_fd = -1

    # -- running ------------------------------------------------------------------------------

    def launch(self, specs: Sequence[LaunchSpec]) -> None:
        for spec in specs:
            started = Launched(spec)
            self.launched.append(started)
            if started.fd is not None:
                self.loop.watch(started.fd, functools.partial(self._launcher_exited, started))
            else:  # no pidfds on this kernel: a bounded poll interval
                self._poll_launcher(started)

    def run(self, first: Callable[[], object] | None = None) -> JobResult:
        """Run the job to its end; ``first`` runs once the loop handles signals (it may raise MPSError)."""
        with self.loop.signals((*STOP_SIGNALS, *FORWARD_SIGNALS), self._on_signal):
            self.loop.watch(self.listener.fileno(), self._accept)
            if self.upstream is not None:
                self._upstream_fd = self.upstream.fileno()
                self.loop.watch(self._upstream_fd, self._on_upstream)
            elif self.policy.timeout is not None:
                self.loop.after(self.policy.timeout, self._timed_out)
            if self.watch is not None:
                self.loop.after(self._watch_every, self._check)
            if first is not None:
                self.loop.after(0, lambda: self._guarded(first))
            self.loop.run_until(self._done)
        self.loop.close()
        return self.judge.result([s.end for s in self.ranks.values() if s.end is not None])

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except MPSError as exc:
            self.fail("setup", exc.exit_code, str(exc))

    def _done(self) -> bool:
        if self.give_up:
            return True
        if self.expected is not None:
            ranks = all(r in self.ranks and self.ranks[r].end is not None for r in self.expected)
            return ranks and all(started.ended for started in self.launched)
        return bool(self.ranks) and all(s.end is not None and s.verdict_sent for s in self.ranks.values())

    def live(self) -> list[RankState]:
        return [s for s in self.ranks.values() if s.end is None]

    def local_pids(self) -> dict[int, int]:
        """``{pid: rank}`` for the live ranks on this host."""
        return {s.process.pid: s.rank for s in self.live() if s.process is not None}

    # -- links ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        link = self.listener.accept()
        if link is not None:
            fd = link.fileno()
            self.loop.watch(fd, lambda: self._on_link(link, fd))

    def _on_link(self, link: Link, fd: int) -> None:
        messages = link.receive()
        if messages is None:
            self.loop.unwatch(fd)
            self._link_lost(link)
            return
        for message in messages:
            kind = message.get("type")
            if not link.peer and kind != "hello":
                link.close()  # a peer must say who it is first
                return
            handler = {"hello": self._hello, "started": self._started, "exited": self._exited,
                       "interrupted": self._interrupted, "finding": self._relayed_finding,
                       "note": self._relayed_note}.get(str(kind))
            if handler is not None:
                handler(link, message)

    def _hello(self, link: Link, message: Mapping[str, Any]) -> None:
        if not token_matches(message.get("token"), self.token):
            link.close()
            return
        if not self.accepting:
            link.send("refuse", retry=True)
            link.close()
            return
        if message.get("role") == "node":  # a node keeper relaying for its ranks
            link.peer = {"role": "node", "node": message.get("node")}
            link.send("welcome")
            return
        try:
            identity = RankIdentity.from_json(message.get("identity") or {})
        except ValueError as exc:
            link.send("refuse", exit_code=ExitCode.SETUP, message=f"mpsrun: bad hello: {exc}")
            link.close()
            return
        link.peer = {"role": "rank", "rank": identity.rank}
        self._welcome(link, identity, message)

    def _welcome(self, link: Link, identity: RankIdentity, message: Mapping[str, Any]) -> None:
        rank = identity.rank
        known = self.ranks.get(rank)
        refusal: tuple[int, str] | None = None
        if known is not None:
            refusal = (ExitCode.SETUP, f"rank {rank} is already part of this job")
        elif self.expected is not None and rank not in self.expected:
            refusal = (ExitCode.SETUP, f"rank {rank} is not part of this job (ranks {ranges(sorted(self.expected))})")
        elif self.stopping is not None:
            refusal = (self.judge.exit_code(), "")
        if refusal is None:
            try:
                answer = self.welcome(identity, message)
            except MPSError as exc:
                refusal = (exc.exit_code, f"mpsrun: error: {exc}")
        state = known or RankState(rank, link)
        self.ranks[rank] = state
        if refusal is None:
            link.send("welcome", **answer)
            return
        link.send("refuse", exit_code=refusal[0], message=refusal[1])
        link.close()
        if known is None:
            state.verdict_sent = True  # the refusal was its verdict
            self._rank_ended(state, RankEnd(rank, None, refusal[0], refusal[1].removeprefix("mpsrun: error: ")))

    def _state_of(self, link: Link, message: Mapping[str, Any]) -> RankState | None:
        rank = link.peer.get("rank") if link.peer.get("role") == "rank" else message.get("rank")
        if not isinstance(rank, int):
            return None
        if link.peer.get("role") == "node" and rank not in self.ranks:
            self.ranks[rank] = RankState(rank, link)  # a rank a node keeper welcomed
        return self.ranks.get(rank)

    def _started(self, link: Link, message: Mapping[str, Any]) -> None:
        state = self._state_of(link, message)
        if state is None:
            return
        pid, start = message.get("pid"), message.get("start")
        if message.get("host") == self.host and isinstance(pid, int) and isinstance(start, int):
            state.process = ProcessRef(pid, start)
            if self.session is not None:
                self.session.add_rank(state.process)
        if self.upstream is not None:
            self.upstream.send("started", **{**message, "rank": state.rank})
        if self.stopping is not None:  # started while the job was already stopping
            self._signal(self.stopping, [state])

    def _exited(self, link: Link, message: Mapping[str, Any]) -> None:
        state = self._state_of(link, message)
        returncode = message.get("returncode")
        if state is None or state.end is not None or not isinstance(returncode, int):
            return
        pid = state.process.pid if state.process is not None else message.get("pid")
        self._rank_ended(state, RankEnd(state.rank, pid, returncode, str(message.get("reason") or "")))

    def _link_lost(self, link: Link) -> None:
        if link is self.upstream:
            return
        for state in [s for s in self.live() if s.link is link]:
            if state.process is not None:  # its leader died with its supervisor; end what it left
                kill_group(state.process.pid, signal.SIGKILL)
            pid = state.process.pid if state.process is not None else None
            self._rank_ended(state, RankEnd(state.rank, pid, None, "its supervisor is gone"))

    # -- decisions ------------------------------------------------------------------------------

    def _rank_ended(self, state: RankState, end: RankEnd) -> None:
        state.end = end
        if self.upstream is not None:
            self.upstream.send("exited", rank=end.rank, pid=end.pid, returncode=end.returncode, reason=end.reason)
            return
        if self.judge.rank_ended(end):
            self._summary_pending = True
            self.stop(signal.SIGTERM)
        self._verdict(state)
        if self.expected is not None and all(r in self.ranks and self.ranks[r].end for r in self.expected):
            self._wind_down()

    def _verdict(self, state: RankState, code: int | None = None, lines: Sequence[str] = ()) -> None:
        if state.verdict_sent:
            return
        state.verdict_sent = True
        end = state.end
        if code is None:
            own = exit_code_of(end.returncode) if end is not None and end.returncode is not None else ExitCode.OK
            code = self.judge.exit_code() if self.judge.failed else own
        lines = list(lines)
        if self.report_in_verdicts and self._summary_pending and state.link is not None and not state.link.closed:
            lines.insert(0, self.judge.message)
            self._summary_pending = False
        closing = self.before_last_verdict
        last = closing is not None and all(s.verdict_sent for s in self.ranks.values())
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

    def stop(self, sig: int, restart: bool = False) -> None:
        """Detach connected ranks from MPS, send ``sig`` to every rank, SIGKILL after ``--grace``."""
        if self.stopping is not None and not restart:
            return
        self.stopping = sig
        self._detach_once()
        self._signal(sig, self.live())
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._kill_timer = self.loop.after(self.policy.grace, lambda: self._signal(signal.SIGKILL, self.live()))

    def _detach_once(self) -> None:
        if self.watch is None or self.session is None or self._detached:
            return
        self._detached = True
        try:
            self.session.detach_clients(list(with_descendants(self.local_pids())))
        except MPSError as exc:  # stopping must go on
            self.note(f"could not detach ranks from MPS before stopping them: {exc}")

    def _signal(self, sig: int, states: Iterable[RankState]) -> None:
        by_link: dict[Link, list[int]] = {}
        for state in states:
            if state.end is not None:
                continue
            if state.link is not None and not state.link.closed:
                by_link.setdefault(state.link, []).append(state.rank)
            elif state.process is not None:
                state.process.signal_group(sig)
        for link, ranks in by_link.items():
            link.send("signal", signal=sig, ranks=ranks)

    # -- events -----------------------------------------------------------------------------------

    def _interrupted(self, link: Link, message: Mapping[str, Any]) -> None:
        """A rank's supervisor got a stopping signal from outside (srun, mpiexec): the job was interrupted."""
        sig = message.get("signal")
        if isinstance(sig, int) and sig in STOP_SIGNALS:
            self._on_signal(sig)

    def _on_signal(self, sig: int) -> None:
        if sig in FORWARD_SIGNALS:
            self._signal(sig, self.live())
        elif self.upstream is not None:  # the job's controller decides; the ranks here get the signal now
            self.upstream.send("interrupted", signal=sig)
            self._signal(sig, self.live())
        elif self.interrupted is not None and sig == signal.SIGINT:
            self.note("second interrupt: killing the ranks now")
            self._signal(signal.SIGKILL, self.live())
        elif self.interrupted is None:
            self.interrupted = sig
            self.note(f"received {signal_name(sig)}; stopping the ranks")
            if self.upstream is None and self.judge.decide("signal", 128 + sig, f"stopped by {signal_name(sig)}"):
                self._summary_pending = True
            self.stop(sig, restart=True)

    def _timed_out(self) -> None:
        timeout = self.policy.timeout
        self.note(f"timeout: the job ran longer than {timeout:g} s; stopping it")
        if self.judge.decide("timeout", ExitCode.TIMEOUT, f"timed out after {timeout:g} s"):
            self._summary_pending = True
        self.stop(signal.SIGTERM)

    def _check(self) -> None:
        if self.watch is None or self.stopping is not None or not self.accepting:
            return
        for finding in self.watch.check(self.local_pids()):
            self._finding(finding)
        self._watch_every = min(self._watch_every * 2, self.policy.watch_interval[1])
        self.loop.after(self._watch_every, self._check)

    def _finding(self, finding: Finding) -> None:
        if finding.fatal:
            self.fail("check-failed", ExitCode.SETUP, finding.message)
        elif self.upstream is not None:
            self.upstream.send("finding", message=finding.message, fatal=False)
        else:
            self.note(f"warning: {finding.message}")

    def _relayed_finding(self, link: Link, message: Mapping[str, Any]) -> None:
        code = message.get("code")
        self._finding(Finding(str(message.get("message")), bool(message.get("fatal"))))
        if isinstance(code, int) and self.judge.cause == "check-failed":
            self.judge.code = code

    def _relayed_note(self, link: Link, message: Mapping[str, Any]) -> None:
        self.notes.append(str(message.get("text")))

    # -- launchers --------------------------------------------------------------------------------

    def _poll_launcher(self, started: Launched) -> None:
        if started.popen.poll() is None:
            self.loop.after(0.05, lambda: self._poll_launcher(started))
        else:
            self._launcher_exited(started)

    def _launcher_exited(self, started: Launched) -> None:
        if started.fd is not None:
            self.loop.unwatch(started.fd)
            with contextlib.suppress(OSError):
                os.close(started.fd)
            started.fd = None
        returncode = started.reap()
        name = started.spec.name
        self.judge.launcher_ended(name, returncode)
        missing = [r for r in started.spec.ranks if r not in self.ranks]
        running = [self.ranks[r] for r in started.spec.ranks if r in self.ranks and self.ranks[r].end is None]
        if missing:
            code = exit_code_of(returncode) or ExitCode.SETUP
            self.fail("launcher-failed", code, f"{name} {describe_returncode(returncode)} before rank(s) "
                      f"{ranges(missing)} started")
            for rank in missing:
                self.ranks[rank] = RankState(rank, end=RankEnd(rank, None, None, "never started"), verdict_sent=True)
        elif returncode != 0 and running:
            self.fail("launcher-failed", exit_code_of(returncode),
                      f"{name} {describe_returncode(returncode)} while rank(s) {ranges([s.rank for s in running])} ran")

    def _wind_down(self) -> None:
        """Every rank has ended: the launchers get ``--grace`` to exit, then SIGTERM, then SIGKILL."""
        if self._winding_down or all(started.ended for started in self.launched):
            return
        self._winding_down = True

        def signal_launchers(sig: int) -> None:
            for started in self.launched:
                started.signal_group(sig)

        grace = max(self.policy.grace, 0.5)
        self.loop.after(grace, lambda: signal_launchers(signal.SIGTERM))
        self.loop.after(2 * grace, lambda: signal_launchers(signal.SIGKILL))

    # -- upstream (a node keeper in a multi-host job) ------------------------------------------------

    def _on_upstream(self) -> None:
        assert self.upstream is not None
        messages = self.upstream.receive()
        if messages is None:
            self.loop.unwatch(self._upstream_fd)
            self.upstream = None
            self.fail("setup", ExitCode.SETUP, "lost the job's controller")
            for state in self.ranks.values():
                if state.end is not None:
                    self._verdict(state)
            return
        for message in messages:
            ranks = message.get("ranks")
            chosen = [s for s in self.ranks.values() if not isinstance(ranks, list) or s.rank in ranks]
            if message.get("type") == "signal" and isinstance(message.get("signal"), int):
                if message["signal"] in STOP_SIGNALS:
                    self._detach_once()
                self._signal(message["signal"], chosen)
            elif message.get("type") == "verdict" and message.get("rank") in self.ranks:
                self._verdict(self.ranks[message["rank"]], message.get("exit_code"), message.get("lines") or ())
