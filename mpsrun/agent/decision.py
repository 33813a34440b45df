"""The job's decision: what its agents' events mean, decided in one place for the whole job.

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

from mpsrun.agent.outcome import Judge, RankEnd
from mpsrun.exitcodes import Cause, signal_name
from mpsrun.runtime.constants import ABORT_WAIT, SAME_INTERRUPT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.protocol import Ended, Started

__all__ = ["Decision", "InterruptSources"]


class InterruptSources:
    """srun and mpiexec signal every rank, so one Ctrl-C reaches a job many times: one interrupt from each source (a
    rank's link) is one; a SIGINT from the same source again, later than a terminal and a launcher would deliver one
    Ctrl-C twice, is the user's second."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}  # source -> when its first interrupt came

    def news(self, sig: int, source: int, interrupted: bool) -> bool:
        """Whether this interrupt is news: the job's first (unless ``interrupted`` already), or a second Ctrl-C."""
        first = self._first.setdefault(source, time.monotonic())
        return not interrupted or (sig == signal.SIGINT and time.monotonic() - first > SAME_INTERRUPT)


class Decision:
    """The top of a job's agents (:class:`mpsrun.agent.agent.Top`). ``stop(sig, again)``: stop every rank of the job
    with ``sig`` (``again``: with this signal now); ``kill()``: SIGKILL them now; ``say``: tell the user; ``running``:
    whether ranks still run (--timeout bounds them; a stopping signal after them comes while the job ends);
    ``summary``: the first failure's line goes with the first deliverable verdict (a bare --per-node job, whose
    ranks are its voice); ``started`` and ``ended``: what else hears of each rank's start and end."""

    def __init__(self, loop: EventLoop, *, stop: Callable[[int, bool], None], kill: Callable[[], None],
                 say: Callable[[str], None], running: Callable[[], bool] = lambda: True, summary: bool = False,
                 started: Callable[[Started], None] = lambda started: None,
                 ended: Callable[[Ended], None] = lambda ended: None) -> None:
        self.judge = Judge()
        self.loop, self.host = loop, socket.gethostname()
        self.interrupted_by: int | None = None  # the first stopping signal from outside
        self.late_signal: int | None = None  # one that came once every rank had ended
        self._stop, self._kill, self._say, self._running = stop, kill, say, running
        self._summary, self._started, self._ended = summary, started, ended
        self._deadline = Deadline(None)
        self._timeout = 0.0
        self._sources = InterruptSources()
        self._refusals: set[str] = set()  # refusals already said
        self._killing = False  # a second interrupt came: the ranks are being killed

    def arm(self, timeout: float | None, total: float | None) -> None:
        """--timeout (``total``), with ``timeout`` of it left as the ranks start."""
        self._deadline, self._timeout = Deadline(timeout), total or timeout or 0.0
        if timeout is not None:
            self.loop.after(timeout, self.timed_out)

    # -- an agent's events --------------------------------------------------------------------------------------

    def rank_started(self, started: Started) -> None:
        self._started(started)

    def rank_ended(self, ended: Ended) -> None:
        """A rank's end: its failure, when the job's first, stops the job (after ABORT_WAIT for one that called
        MPI_Abort: its launcher ends the others)."""
        if self._deadline.expired() and not self.judge.failed:  # the timer is late (the loop was held up): it
            self.timed_out()  # comes first all the same
        if self.judge.rank_ended(RankEnd.of(ended, self.host)):
            if ended.aborting:
                self.loop.after(ABORT_WAIT, lambda: self._stop(signal.SIGTERM, False))
            else:
                self._stop(signal.SIGTERM, False)
        self._ended(ended)

    def refused(self, code: int, message: str) -> str:
        """A refusal is said once: by the first rank refused for it."""
        said, self._refusals = message in self._refusals, self._refusals | {message}
        return "" if said else message

    def failed(self, code: int, message: str) -> None:
        self.fail(Cause.CHECK_FAILED, code, message)

    def warned(self, message: str) -> None:
        self._say(f"warning: {message}")

    def interrupted(self, sig: int, source: int) -> None:
        """A rank's supervisor (or an agent) got a stopping signal from outside. Not the launcher ending the other
        ranks of a failed job (Open MPI's mpiexec SIGTERMs them): nothing to say."""
        if not (self.judge.failed and self.interrupted_by is None) and \
                self._sources.news(sig, source, self.interrupted_by is not None):
            self.signalled(sig)

    def verdict(self, own: int, deliverable: bool) -> tuple[int, list[str]]:
        """A rank's exit code once the job has failed is the job's; the summary goes with the first deliverable."""
        if not self.judge.failed:
            return own, []
        lines = [self.judge.message] if self._summary and deliverable else []
        self._summary = self._summary and not deliverable
        return self.judge.exit_code(), lines

    def closing(self, lines: list[str]) -> list[str]:
        """The node's last words go with its last verdict."""
        return lines

    def peaks(self, peaks: dict[int, int]) -> None:
        """Nothing to decide."""

    # -- what the job's own events mean -------------------------------------------------------------------------

    def fail(self, cause: Cause, code: int | None, message: str) -> None:
        """The job fails for a reason of its own, unless something failed first."""
        if self.judge.decide(cause, code, message):
            self._stop(signal.SIGTERM, False)

    def signalled(self, sig: int) -> None:
        """A stopping signal: the first stops the job, a second SIGINT kills the ranks now. Once every rank has
        ended one is only noted: the job's end has deadlines of its own."""
        if not self._running():
            self.late_signal = self.late_signal or sig
        elif self.interrupted_by is None:
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
        if self._running() and self.judge.decide(Cause.TIMEOUT, None, f"timed out after {self._timeout:g} s"):
            self._stop(signal.SIGTERM, False)  # (the summary says it: a line here too said it twice)
