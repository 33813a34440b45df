"""How a job ended: the first failure decides the exit code, and the summary names it.

One judge for every path: the launcher's controller and a node keeper use the same rules,
so a job gives the same exit code and the same summary however its ranks were started.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from mpsrun.exitcodes import Cause, ExitCode, Outcome, describe_returncode, exit_code, killed_by, signal_name
from mpsrun.runtime.constants import USAGE_INTERVAL, WATCH_INTERVAL

if TYPE_CHECKING:
    from mpsrun.config.options import JobConfig
    from mpsrun.runtime.deadline import Deadline
    from mpsrun.runtime.protocol import Ended

__all__ = ["JobResult", "Judge", "Policy", "RankEnd", "ranges"]


def ranges(values: Sequence[int]) -> str:
    """``0-3,5``: a compact list of rank numbers."""
    parts: list[list[int]] = []
    for value in sorted(set(values)):
        if parts and parts[-1][1] == value - 1:
            parts[-1][1] = value
        else:
            parts.append([value, value])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts) or "none"


class Policy(NamedTuple):
    """The rules a controller applies: how long a rank gets to end when stopped, the job's time, what fails it."""
    grace: float  # --grace
    timeout: float | None = None  # seconds left of the job's --timeout when the ranks start
    timeout_total: float | None = None  # the --timeout itself, for the message
    mps_required: bool = False  # --mps on: a rank found without MPS fails the job
    watch_interval: float = WATCH_INTERVAL
    usage_interval: float = USAGE_INTERVAL
    keep_samples: bool = False  # --report: the memory samples are kept for it

    @classmethod
    def for_job(cls, config: JobConfig, deadline: Deadline) -> Policy:
        """The rules of ``config``'s job, with what is left of its --timeout (``deadline``) when the ranks start."""
        return cls(grace=config.grace, timeout=deadline.remaining() if config.timeout else None,
                   timeout_total=config.timeout, mps_required=config.mps == "on", keep_samples=bool(config.report))


class RankEnd(NamedTuple):
    """How one rank ended. ``returncode`` is None for a rank lost without a report. ``wall`` and ``cpu``: its
    program's seconds running and of CPU, where its supervisor said; ``host``: where it ran, where a pid alone does
    not say it (under ``--hosts``, another host)."""

    rank: int
    pid: int | None
    returncode: int | None
    reason: str = ""
    aborting: bool = False  # reported as its MPI_Abort began: the MPI launcher ends the job's other ranks
    wall: float | None = None
    cpu: float | None = None
    host: str = ""

    @classmethod
    def of(cls, ended: Ended, here: str) -> RankEnd:
        """A rank's end as its agent told it; its host named where it is not ``here``."""
        return cls(ended.rank, ended.pid, ended.returncode, ended.reason, ended.aborting, ended.wall, ended.cpu,
                   ended.host if ended.host != here else "")

    def describe(self, first: bool = False) -> str:
        """``rank 1 (pid N[ on HOST]) exited with code 7[ first][: reason]``."""
        where = [f"pid {self.pid}"] if self.pid else []
        where += [f"on {self.host}"] if self.host else []
        return f"rank {self.rank}" + (f" ({' '.join(where)})" if where else "") + f" {self.what(first)}"

    def what(self, first: bool = False) -> str:
        """``exited with code 7[ first][: reason]``: how it ended, without who."""
        if self.returncode is None:
            return "ended without reporting" + (" first" if first else "") + (
                f" ({self.reason})" if self.reason else "")
        what = describe_returncode(self.returncode) + (" first" if first else "")
        return what + (f": {self.reason}" if self.reason else "")


class JobResult(NamedTuple):
    """How a job ended: its exit code, the cause (:class:`mpsrun.exitcodes.Cause`) and the summary line."""

    exit_code: int
    cause: str
    message: str = ""


class Judge:
    """Keeps the job's first failure; everything after it only follows. The exit code comes from
    :func:`mpsrun.exitcodes.exit_code`, as on every other path."""

    def __init__(self) -> None:
        self.outcome = Outcome()
        self.message = ""
        self.first: RankEnd | None = None
        self._launcher: tuple[str, int, int | None] | None = None  # an MPI launcher's end: name, status, offset

    @property
    def failed(self) -> bool:
        return self.outcome.cause != Cause.OK

    @property
    def cause(self) -> str:
        return self.outcome.cause

    def rank_ended(self, end: RankEnd) -> bool:
        """Record a rank's end; True when it is the job's first failure."""
        if end.returncode == ExitCode.OK:
            return False
        if self.failed:
            self._lost_host_explains(end)
            return False
        self.first = end
        first = self.decide(Cause.RANK_FAILED, end.returncode, end.describe(first=True))
        self._lost_takes_launcher_status()
        return first

    def _lost_host_explains(self, end: RankEnd) -> None:
        """A rank lost with another host's node keeper explains a rank of this host lost unreported before it: once a
        host is gone the MPI launcher ends the job's other processes, and under load their end may come first. The
        summary then names the host."""
        first = self.first
        if self.outcome.cause != Cause.RANK_FAILED or first is None or first.returncode is not None or first.host \
                or end.returncode is not None or not end.host:
            return
        self.first, self.outcome, self.message = end, Outcome(Cause.RANK_FAILED, None), end.describe(first=True)
        self._lost_takes_launcher_status()

    def decide(self, cause: str, detail: int | None, message: str) -> bool:
        """The job fails for this reason unless something failed first; True if this is first."""
        if self.failed:
            return False
        self.outcome, self.message = Outcome(cause, detail), message
        return True

    def launcher_ended(self, name: str, returncode: int, signal_status: int | None = None) -> None:
        """A launcher process's status gives a lost rank its code (MPI_Abort's, say), also one reported lost after
        the launcher ended. ``signal_status``: the launcher exits with this plus S for a process killed by signal
        S (Open MPI: 128), so a rank whose supervisor vanished is said in the local launcher's words."""
        if returncode != 0:
            self._launcher = (name, returncode, signal_status)
            self._lost_takes_launcher_status()

    def _lost_takes_launcher_status(self) -> None:
        if self._launcher is None or self.outcome != Outcome(Cause.RANK_FAILED, None) or self.first is None:
            return
        name, returncode, signal_status = self._launcher
        signalled = killed_by(returncode, signal_status)
        if signalled is not None:
            self.outcome = Outcome(Cause.RANK_FAILED, -signalled)
            self.message += (f"; rank {self.first.rank}'s supervisor {describe_returncode(-signalled)} "
                             f"({name} exited with code {returncode})")
        else:
            self.outcome = Outcome(Cause.RANK_FAILED, returncode)
            self.message += f"; {name} {describe_returncode(returncode)}"

    def exit_code(self) -> int:
        return exit_code(self.outcome)

    def result(self, teardown_failure: str = "", late_signal: int | None = None) -> JobResult:
        """The job's result once it has ended: a teardown that failed, or a signal while it ended, counts only
        when nothing failed first."""
        outcome = self.outcome._replace(teardown_failed=bool(teardown_failure), late_signal=late_signal)
        cause, message = self.outcome.cause, self.message
        if not self.failed and teardown_failure:
            cause, message = Cause.TEARDOWN_FAILED, teardown_failure
        elif not self.failed and late_signal:
            cause, message = Cause.SIGNAL, f"interrupted by {signal_name(late_signal)} while ending the job"
        return JobResult(exit_code(outcome), str(cause), message)
