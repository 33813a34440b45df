"""A node keeper under ``mpsrun --hosts``: it relays its ranks to the job's controller and carries out its word.

Its ranks' starts, ends, interrupts and the watch's findings go up the ``upstream`` link; the job's
controller (:class:`~mpsrun.job.jobcontroller.JobController`) judges the whole job and sends each rank's
verdict and every stop signal down. Should that link be lost, the node stops its ranks on its own
(exit 3: the job's controller died under them).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from mpsrun.exitcodes import ExitCode
from mpsrun.job.controller import Admit
from mpsrun.job.outcome import Policy, RankEnd
from mpsrun.job.table import RankState
from mpsrun.mps.watch import Finding
from mpsrun.node.controller import NodeSide, Starter
from mpsrun.runtime.constants import STOP_SIGNALS, VERDICT_WAIT
from mpsrun.runtime.protocol import Exited, Found, Interrupted, Link, Listener, Note, SignalRanks, Started, Verdict
from mpsrun.session.session import Session

__all__ = ["RelayController"]


class RelayController(NodeSide):
    """``upstream``: the link to the job's controller, already welcomed."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, *, session: Session,
                 expected: int | None, close: Callable[[], list[str]], upstream: Link,
                 starter: Starter | None = None) -> None:
        super().__init__(listener, token, welcome, policy, session=session, expected=expected, close=close,
                         starter=starter)
        self.upstream = upstream
        self._orphaned = False  # the job's controller is gone: this node decides alone (exit 3)

    def _arm(self) -> None:
        super()._arm()
        self.loop.watch(self.upstream.fd, self._on_upstream)

    def fail(self, cause: str, code: int, message: str) -> None:
        self.upstream.send(Found(message, True, code))
        self.stop(signal.SIGTERM)

    def _once(self, code: int, refusal: str) -> str:
        """A refusal is said once, by the job's controller: it is the job's summary line."""
        if refusal and refusal not in self._refusals:
            self._refusals.add(refusal)
            self.upstream.send(Found(refusal.removeprefix("mpsrun: error: "), True, code))
        return ""

    def _refusal_code(self) -> int:
        return ExitCode.SETUP if self._orphaned else ExitCode.OK

    def _verdict_code(self, state: RankState) -> int:
        return ExitCode.SETUP if self._orphaned else super()._verdict_code(state)

    def _started(self, state: RankState, message: Started) -> None:
        self.upstream.send(message._replace(rank=state.rank))

    def _ended(self, state: RankState, end: RankEnd) -> None:
        if self._orphaned:
            self._verdict(state)
            return
        self.upstream.send(Exited(end.rank, end.returncode, end.reason, end.pid, end.aborting))
        if not self.table.live():  # the job's controller answers at once; should it not, the node must close
            self.loop.after(VERDICT_WAIT, self._verdicts_overdue)

    def _stop_signal(self, sig: int) -> None:
        """The job's controller decides; the ranks here get the signal now."""
        self.interrupted_by = self.interrupted_by or sig
        self.upstream.send(Interrupted(sig))
        self._signal(sig, self.table.live())

    def _warn(self, finding: Finding) -> None:
        self.upstream.send(Found(finding.message, False))

    def _delivered(self, lines: list[str]) -> list[str]:
        for line in lines:
            self.upstream.send(Note(line))
        return []

    def _verdicts_overdue(self) -> None:
        for state in self.ranks.values():
            if state.end is not None and not state.verdict_sent:
                self._verdict(state)

    def _on_upstream(self) -> None:
        messages = self.upstream.receive()
        if messages is None:
            self._lost_upstream()
            return
        for message in messages:
            if isinstance(message, SignalRanks):
                if message.signal in STOP_SIGNALS:
                    self._detach_once()
                chosen = [s for s in self.ranks.values() if message.ranks is None or s.rank in message.ranks]
                self._signal(message.signal, chosen)
            elif isinstance(message, Verdict) and message.rank in self.ranks:
                self._verdict(self.ranks[message.rank], message.exit_code, message.lines)

    def _lost_upstream(self) -> None:
        """The job's controller is gone: stop the node's ranks, and give every ended one its verdict (exit 3)."""
        self.loop.unwatch(self.upstream.fd)  # before the close: see Link
        self.upstream.close()
        self._orphaned = True
        self.stop(signal.SIGTERM)
        self._verdicts_overdue()
