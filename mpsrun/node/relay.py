"""Relaying: the decider of a node keeper's controller under ``mpsrun --hosts``.

Its ranks' starts, ends, interrupts and the watch's findings go up the ``upstream`` link; the job's
controller (:class:`~mpsrun.job.jobcontroller.JobController`) judges the whole job and sends each rank's
verdict and every stop signal down. Should that link be lost, the node stops its ranks on its own
(exit 3: the job's controller died under them).
"""

from __future__ import annotations

import signal

from mpsrun.exitcodes import ExitCode
from mpsrun.job.controller import Controller
from mpsrun.job.outcome import RankEnd
from mpsrun.job.table import RankState
from mpsrun.mps.watch import Finding
from mpsrun.runtime.constants import STOP_SIGNALS, VERDICT_WAIT
from mpsrun.runtime.protocol import Found, Interrupted, Link, Note, SignalRanks, Started, Verdict

__all__ = ["Relaying"]


class Relaying:
    """The decider of ``controller``; ``upstream``: the link to the job's controller, already admitted."""

    def __init__(self, controller: Controller, upstream: Link) -> None:
        self.controller = controller
        self.upstream = upstream
        self._orphaned = False  # the job's controller is gone: this node decides alone (exit 3)
        self._refusals: set[str] = set()  # refusals already sent up

    def arm(self) -> None:
        self.controller.loop.watch(self.upstream.fd, self._on_upstream)

    def heeds_interrupt(self) -> bool:
        return True  # the job's controller decides what an interrupt means

    def fail(self, cause: str, code: int, message: str) -> None:
        self.upstream.send(Found(message, True, code))
        self.controller.stop(signal.SIGTERM)

    def once(self, code: int, refusal: str) -> str:
        """A refusal is said once, by the job's controller: it is the job's summary line."""
        if refusal and refusal not in self._refusals:
            self._refusals.add(refusal)
            self.upstream.send(Found(refusal.removeprefix("mpsrun: "), True, code))  # "error: ...", as the job says
        return ""

    def refusal_code(self) -> int:
        return ExitCode.SETUP if self._orphaned else ExitCode.OK

    def verdict_code(self, state: RankState) -> int:
        return ExitCode.SETUP if self._orphaned else state.own_code()

    def started(self, state: RankState, message: Started) -> None:
        self.upstream.send(message._replace(rank=state.rank))

    def ended(self, state: RankState, end: RankEnd) -> None:
        if self._orphaned:
            self.controller.verdict(state)
            return
        self.controller.settle_watch()  # its MPS membership, as the node's verified line will say it
        self.upstream.send(self.controller.account(state).message(end.reason, end.aborting))
        if not self.controller.table.live():  # the job's controller answers at once; should it not, the node must close
            self.controller.loop.after(VERDICT_WAIT, self._verdicts_overdue)

    def stop_signal(self, sig: int, first: bool) -> None:
        """The job's controller decides; the ranks here get the signal now."""
        self.upstream.send(Interrupted(sig))
        self.controller.signal_ranks(sig, self.controller.table.live())

    def link_closed(self, link: Link) -> None:
        """A rank's supervisor gone is a lost rank, which its end says: the job's controller decides."""

    def warn(self, finding: Finding) -> None:
        self.upstream.send(Found(finding.message, False))

    def delivered(self, lines: list[str]) -> list[str]:
        """The node's last words go up to the job's controller, which says them at the job's end."""
        for line in lines:
            self.upstream.send(Note(line))
        return []

    def _verdicts_overdue(self) -> None:
        for state in self.controller.ranks.values():
            if state.end is not None and not state.verdict_sent:
                self.controller.verdict(state)

    def _on_upstream(self) -> None:
        messages = self.upstream.receive()
        if messages is None:
            self._lost_upstream()
            return
        controller = self.controller
        for message in messages:
            if isinstance(message, SignalRanks):
                if message.signal in STOP_SIGNALS:
                    controller.detach_once()
                chosen = [s for s in controller.ranks.values() if message.ranks is None or s.rank in message.ranks]
                controller.signal_ranks(message.signal, chosen)
            elif isinstance(message, Verdict) and message.rank in controller.ranks:
                controller.verdict(controller.ranks[message.rank], message.exit_code, message.lines)

    def _lost_upstream(self) -> None:
        """The job's controller is gone: stop the node's ranks, and give every ended one its verdict (exit 3)."""
        self.controller.loop.unwatch(self.upstream.fd)  # before the close: see Link
        self.upstream.close()
        self._orphaned = True
        self.controller.stop(signal.SIGTERM)
        self._verdicts_overdue()
