"""Judging: the decider of a controller that decides the job's outcome itself.

The first failure (a rank's end, a signal, the timeout, a check) sets the exit code of every rank
after it and of the job (:class:`~mpsrun.job.outcome.Judge`). The ``mpsrun`` command's controller
judges its job, and so does a bare ``--per-node`` job's node keeper.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from mpsrun.exitcodes import signal_name
from mpsrun.job.controller import Controller
from mpsrun.job.outcome import JobResult, Judge, RankEnd
from mpsrun.job.table import RankState
from mpsrun.mps.watch import Finding
from mpsrun.runtime.constants import ABORT_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.protocol import Link, Started

__all__ = ["Judging"]


class Judging:
    """The decider of ``controller``. ``timeout_applies``: whether --timeout still stops the job when its timer
    fires (the job's controller: not once every rank has ended, nor for a job that never ran)."""

    def __init__(self, controller: Controller, timeout_applies: Callable[[], bool] = lambda: True) -> None:
        self.controller = controller
        self.judge = Judge()
        self._timeout_applies = timeout_applies
        self._deadline = Deadline(None)  # --timeout's, once armed
        self._aborting: Link | None = None  # the link of a rank whose MPI_Abort ends the job's ranks
        self._refusals: set[str] = set()  # refusals already said
        self._killing = False  # a second interrupt came: the ranks are being killed

    def result(self, teardown_failure: str = "", late_signal: int | None = None) -> JobResult:
        ranks = self.controller.ranks.values()
        return self.judge.result([s.end for s in ranks if s.end is not None], teardown_failure, late_signal)

    def arm(self) -> None:
        timeout = self.controller.policy.timeout
        self._deadline = Deadline(timeout)
        if timeout is not None:
            self.controller.loop.after(timeout, self.timed_out)

    def heeds_interrupt(self) -> bool:
        """Not the launcher ending the other ranks of a failed job (Open MPI's mpiexec SIGTERMs them): no interrupt,
        and nothing to say."""
        return not (self.judge.failed and self.controller.interrupted_by is None)

    def fail(self, cause: str, code: int, message: str) -> None:
        self.judge.decide(cause, code, message)
        self.controller.stop(signal.SIGTERM)

    def ended(self, state: RankState, end: RankEnd) -> None:
        controller = self.controller
        if self._deadline.expired() and not self.judge.failed:  # the timer is late (the loop was held up): it
            self.timed_out()  # comes first all the same
        if self.judge.rank_ended(end):
            if end.aborting and state.link is not None:  # its launcher ends the other ranks; those left are stopped
                self._aborting = state.link
                controller.loop.after(ABORT_WAIT, lambda: controller.stop(signal.SIGTERM))
            else:
                controller.stop(signal.SIGTERM)
        controller.verdict(state)

    def link_closed(self, link: Link) -> None:
        if link is self._aborting:
            self.controller.stop(signal.SIGTERM)

    def stop_signal(self, sig: int, first: bool) -> None:
        controller = self.controller
        if not first and sig == signal.SIGINT:
            if not self._killing:  # each rank's supervisor may pass the user's second Ctrl-C on: said once
                controller.note("second interrupt: killing the ranks now")
            self._killing = True
            controller.kill_now()
        elif first:
            controller.note(f"received {signal_name(sig)}; stopping the ranks")
            self.judge.decide("signal", sig, f"stopped by {signal_name(sig)}")
            controller.stop(sig, restart=True)

    def timed_out(self) -> None:
        policy = self.controller.policy
        timeout = policy.timeout_total or policy.timeout
        if not self._timeout_applies():
            return
        # Not after a failure, nor twice; the summary at the end says it (a line here too said it twice).
        if self.judge.decide("timeout", None, f"timed out after {timeout:g} s"):
            self.controller.stop(signal.SIGTERM)

    def started(self, state: RankState, message: Started) -> None:
        """Nothing to tell anyone: the job is judged here."""

    def warn(self, finding: Finding) -> None:
        self.controller.note(f"warning: {finding.message}")

    def verdict_code(self, state: RankState) -> int:
        return self.judge.exit_code() if self.judge.failed else state.own_code()

    def refusal_code(self) -> int:
        return self.judge.exit_code()

    def once(self, code: int, refusal: str) -> str:
        """A refusal is said once: by the first rank refused for it."""
        if not refusal or refusal in self._refusals:
            return ""
        self._refusals.add(refusal)
        return refusal

    def delivered(self, lines: list[str]) -> list[str]:
        return lines
