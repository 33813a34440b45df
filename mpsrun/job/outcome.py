"""How a job ended: the first failure decides the exit code, and the summary names it.

One judge for every path: the launcher's controller and a node keeper use the same rules,
so a job gives the same exit code and the same summary however its ranks were started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mpsrun.exitcodes import ExitCode, describe_returncode, exit_code_of

__all__ = ["JobResult", "Judge", "RankEnd", "ranges"]


def ranges(values: Sequence[int]) -> str:
    """``0-3,5``: a compact list of rank numbers."""
    parts: list[list[int]] = []
    for value in sorted(set(values)):
        if parts and parts[-1][1] == value - 1:
            parts[-1][1] = value
        else:
            parts.append([value, value])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts) or "none"


@dataclass(slots=True)
class RankEnd:
    """How one rank ended. ``returncode`` is None for a rank lost without a report."""

    rank: int
    pid: int | None
    returncode: int | None
    reason: str = ""

    @property
    def lost(self) -> bool:
        return self.returncode is None

    def describe(self, first: bool = False) -> str:
        """``rank 1 (pid N) exited with code 7[ first][: reason]``."""
        who = f"rank {self.rank}" + (f" (pid {self.pid})" if self.pid else "")
        if self.returncode is None:
            return f"{who} ended without reporting" + (" first" if first else "") + (
                f" ({self.reason})" if self.reason else "")
        what = describe_returncode(self.returncode) + (" first" if first else "")
        return f"{who} {what}" + (f": {self.reason}" if self.reason else "")


@dataclass(slots=True)
class JobResult:
    """``cause``: ok, rank-failed, launcher-failed, timeout, signal, check-failed or setup."""

    exit_code: int
    cause: str
    message: str = ""
    first_failure: RankEnd | None = None
    ends: list[RankEnd] = field(default_factory=list)


class Judge:
    """Keeps the first failure; everything after it only follows."""

    def __init__(self) -> None:
        self.cause: str | None = None
        self.code: int | None = None
        self.message = ""
        self.first: RankEnd | None = None

    @property
    def failed(self) -> bool:
        return self.cause is not None

    def rank_ended(self, end: RankEnd) -> bool:
        """Record a rank's end; True when it is the job's first failure."""
        if end.returncode == 0 or self.failed:
            return False
        self.first = end
        code = None if end.returncode is None else exit_code_of(end.returncode)
        return self.decide("rank-failed", code, end.describe(first=True))

    def decide(self, cause: str, code: int | None, message: str) -> bool:
        """The job fails for this reason unless something failed first; True if this is first."""
        if self.failed:
            return False
        self.cause, self.code, self.message = cause, code, message
        return True

    def launcher_ended(self, name: str, returncode: int) -> None:
        """A launcher process's status gives a lost rank its code (MPI_Abort's, say)."""
        if self.cause == "rank-failed" and self.code is None and returncode != 0:
            self.code = exit_code_of(returncode)
            self.message += f"; {name} {describe_returncode(returncode)}"

    def exit_code(self) -> int:
        if self.cause is None:
            return ExitCode.OK
        return exit_code_of(-9) if self.code is None else self.code  # lost, no better word: as if SIGKILLed

    def result(self, ends: Sequence[RankEnd]) -> JobResult:
        return JobResult(self.exit_code(), self.cause or "ok", self.message, self.first, sorted(ends, key=_by_rank))


def _by_rank(end: RankEnd) -> int:
    return end.rank
