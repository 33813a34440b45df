"""The job's decision: what its events mean, decided in one place for the whole job.

The ``mpsrun`` command decides for its job (its own node's agent, or the hosts' agents under ``--hosts``); a bare
``--per-node`` job's agent decides for its node, which is the job there. The first failure (a rank's end, a finding, a
signal, the timeout) decides the job's exit code and its summary (:class:`~mpsrun.agent.outcome.Judge`), and the
exit code of every rank judged after it; the job is then stopped, once.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable

from mpsrun.agent.outcome import Judge, Policy, RankEnd
from mpsrun.exitcodes import Cause, signal_name
from mpsrun.runtime.constants import ABORT_WAIT, SAME_INTERRUPT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.protocol import Ended, Started

__all__ = ["Decision", "InterruptSources"]


class InterruptSources:
    """Where interrupts came from. srun and mpiexec signal every rank, so one Ctrl-C reaches a job many times: one
    from each source (a rank's link) is one interrupt; a SIGINT from the same source again, later than a terminal and
    a launcher would deliver one Ctrl-C twice, is the user's second Ctrl-C."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}  # source -> when its first interrupt came

    def news(self, sig: int, source: int, interrupted: bool) -> bool:
        """Whether this interrupt is news: the job's first (unless ``interrupted`` already), or a second Ctrl-C."""
        now = time.monotonic()
        first = self._first.setdefault(source, now)
        return not interrupted or (sig == signal.SIGINT and now - first > SAME_INTERRUPT)


class Decision:
    """``stop(sig, restart)``: stop every rank of the job with ``sig`` (``restart``: again, with this signal);
    ``kill()``: SIGKILL them now; ``say``: tell the user; ``running``: whether ranks of the job still run (--timeout
    bounds them, and a stopping signal after them comes while the job ends); ``summary``: the first failure's line
    goes with the first verdict that can be delivered (a bare --per-node job, whose ranks are its voice)."""

    def __init__(self, loop: EventLoop, policy: Policy, *, stop: Callable[[int, bool], None],
                 kill: Callable[[], None], say: Callable[[str], None], running: Callable[[], bool] = lambda: True,
                 summary: bool = False) -> None:
        self.judge = Judge()
        self.loop, self.policy, self.host = loop, policy, socket.gethostname()
        self.interrupted_by: int | None = None  # the first stopping signal from outside
        self.late_signal: int | None = None  # one that came once every rank had ended
        self._stop, self._kill, self._say, self._running = stop, kill, say, running
        self._summary = summary
        self._deadline = Deadline(policy.timeout)
        self._sources = InterruptSources()
        self._refusals: set[str] = set()  # refusals already said
        self._killing = False  # a second interrupt came: the ranks are being killed
        if policy.timeout is not None:
            loop.after(policy.timeout, self.timed_out)

    # -- an agent's events (see mpsrun.agent.agent.Top) ---------------------------------------------------------

    def rank_started(self, started: Started) -> None:
        """Nothing to decide."""

    def rank_ended(self, ended: Ended) -> None:
        self.end(RankEnd.of(ended, self.host))

    def failed(self, code: int, message: str) -> None:
        self.fail(Cause.CHECK_FAILED, code, message)

    def closing(self, lines: list[str]) -> list[str]:
        return lines

    def peaks(self, peaks: dict[int, int]) -> None:
        """Nothing to decide."""

    # -- what the job's events mean -----------------------------------------------------------------------------

    def end(self, end: RankEnd) -> None:
        """A rank has ended: its failure, when the job's first, stops the job (after ABORT_WAIT for one that called
        MPI_Abort: its launcher ends the others)."""
        if self._deadline.expired() and not self.judge.failed:  # the timer is late (the loop was held up): it
            self.timed_out()  # comes first all the same
        if self.judge.rank_ended(end):
            if end.aborting:
                self.loop.after(ABORT_WAIT, lambda: self._stop(signal.SIGTERM, False))
            else:
                self._stop(signal.SIGTERM, False)

    def fail(self, cause: Cause, code: int | None, message: str) -> None:
        """The job fails for a reason of its own (unless something failed first)."""
        if self.judge.decide(cause, code, message):
            self._stop(signal.SIGTERM, False)

    def refused(self, code: int, message: str) -> str:
        """A refusal is said once: by the first rank refused for it."""
        if message in self._refusals:
            return ""
        self._refusals.add(message)
        return message

    def warned(self, message: str) -> None:
        self._say(f"warning: {message}")

    def verdict(self, own: int, deliverable: bool) -> tuple[int, list[str]]:
        """A rank's exit code once the job has failed is the job's; the summary goes with the first deliverable."""
        if not self.judge.failed:
            return own, []
        lines = [self.judge.message] if self._summary and deliverable else []
        self._summary = self._summary and not deliverable
        return self.judge.exit_code(), lines

    def interrupted(self, sig: int, source: int) -> None:
        """A rank's supervisor (or an agent) got a stopping signal from outside (see :class:`InterruptSources`). Not
        the launcher ending the other ranks of a failed job (Open MPI's mpiexec SIGTERMs them): nothing to say."""
        if self.judge.failed and self.interrupted_by is None:
            return
        if self._sources.news(sig, source, self.interrupted_by is not None):
            self.signalled(sig)

    def signalled(self, sig: int) -> None:
        """A stopping signal: the first stops the job; a second SIGINT kills the ranks now. Once every rank has
        ended, one is only noted: the job's end has deadlines of its own."""
        if not self._running():
            self.late_signal = self.late_signal or sig
            return
        first = self.interrupted_by is None
        if first:
            self.interrupted_by = sig
            self._say(f"received {signal_name(sig)}; stopping the ranks")
            self.judge.decide(Cause.SIGNAL, sig, f"stopped by {signal_name(sig)}")
            self._stop(sig, True)
        elif sig == signal.SIGINT:
            if not self._killing:  # each rank's supervisor may pass the user's second Ctrl-C on: said once
                self._say("second interrupt: killing the ranks now")
            self._killing = True
            self._kill()

    def timed_out(self) -> None:
        """--timeout: the job's first failure, unless something failed first or its ranks are over."""
        timeout = self.policy.timeout_total or self.policy.timeout
        if self._running() and self.judge.decide(Cause.TIMEOUT, None, f"timed out after {timeout:g} s"):
            self._say(f"timeout: the job ran longer than {timeout:g} s; stopping it")
            self._stop(signal.SIGTERM, False)
