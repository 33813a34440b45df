"""A node keeper under ``mpsrun --hosts``: it relays its ranks to the job's controller and carries out its word.

Its ranks' starts, ends, interrupts and the watch's findings go up the ``upstream`` link; the job's
controller (:class:`~mpsrun.job.jobcontroller.JobController`) judges the whole job and sends each rank's
verdict and every stop signal down. Should that link be lost, the node stops its ranks on its own
(exit 3: the job's controller died under them).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from typing import Any

from mpsrun.exitcodes import ExitCode
from mpsrun.job.controller import Welcome
from mpsrun.job.outcome import Policy, RankEnd
from mpsrun.job.table import RankState
from mpsrun.mps.watch import Finding
from mpsrun.node.controller import NodeSide, Starter
from mpsrun.runtime.constants import STOP_SIGNALS, VERDICT_WAIT
from mpsrun.runtime.protocol import Link, Listener
from mpsrun.session.session import Session

__all__ = ["RelayController"]


class RelayController(NodeSide):
    """``upstream``: the link to the job's controller, already welcomed."""

    def __init__(self, listener: Listener, token: str, welcome: Welcome, policy: Policy, *, session: Session,
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
        self.upstream.send("finding", message=message, fatal=True, code=code)
        self.stop(signal.SIGTERM)

    def _once(self, code: int, refusal: str) -> str:
        """A refusal is said once, by the job's controller: it is the job's summary line."""
        if refusal and refusal not in self._refusals:
            self._refusals.add(refusal)
            self.upstream.send("finding", message=refusal.removeprefix("mpsrun: error: "), fatal=True, code=code)
        return ""

    def _refusal_code(self) -> int:
        return ExitCode.SETUP if self._orphaned else ExitCode.OK

    def _verdict_code(self, state: RankState) -> int:
        return ExitCode.SETUP if self._orphaned else super()._verdict_code(state)

    def _started(self, state: RankState, message: Mapping[str, Any]) -> None:
        fields = {k: v for k, v in message.items() if k != "type"}
        self.upstream.send("started", **{**fields, "rank": state.rank})

    def _ended(self, state: RankState, end: RankEnd) -> None:
        if self._orphaned:
            self._verdict(state)
            return
        self.upstream.send("exited", rank=end.rank, pid=end.pid, returncode=end.returncode, reason=end.reason,
                           aborting=end.aborting)
        if not self.table.live():  # the job's controller answers at once; should it not, the node must close
            self.loop.after(VERDICT_WAIT, self._verdicts_overdue)

    def _stop_signal(self, sig: int) -> None:
        """The job's controller decides; the ranks here get the signal now."""
        self.interrupted_by = self.interrupted_by or sig
        self.upstream.send("interrupted", signal=sig)
        self._signal(sig, self.table.live())

    def _warn(self, finding: Finding) -> None:
        self.upstream.send("finding", message=finding.message, fatal=False)

    def _delivered(self, lines: list[str]) -> list[str]:
        for line in lines:
            self.upstream.send("note", text=line)
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
            ranks = message.get("ranks")
            chosen = [s for s in self.ranks.values() if ranks is None or s.rank in ranks]
            if message["type"] == "signal":
                if message["signal"] in STOP_SIGNALS:
                    self._detach_once()
                self._signal(message["signal"], chosen)
            elif message["type"] == "verdict" and message["rank"] in self.ranks:
                self._verdict(self.ranks[message["rank"]], message["exit_code"], message.get("lines") or ())

    def _lost_upstream(self) -> None:
        """The job's controller is gone: stop the node's ranks, and give every ended one its verdict (exit 3)."""
        self.loop.unwatch(self.upstream.fd)  # before the close: see Link
        self.upstream.close()
        self._orphaned = True
        self.stop(signal.SIGTERM)
        self._verdicts_overdue()
