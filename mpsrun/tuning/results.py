"""What ``mpsrun tune`` measured, and what it concludes: each setting's runs and spread, the baseline, the best,
its ties, and the setting to recommend.

A setting's spread is the range (min to max) of its runs' throughputs. Two settings whose ranges overlap are a
tie: neither is shown better than the other. The best setting is recommended only when its range lies wholly
above the baseline's; otherwise nothing beat the baseline beyond the noise, and the baseline is recommended.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from mpsrun.tuning.grid import Setting, TuneJob

__all__ = ["Run", "Trial", "TuneResult"]


@dataclass(frozen=True, slots=True)
class Run:
    """One job of one setting: its wall seconds, exit code and throughput (None when it failed: ``error``)."""

    seconds: float
    exit_code: int
    throughput: float | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class Trial:
    """Every run of one setting."""

    setting: Setting
    runs: tuple[Run, ...] = ()

    @property
    def throughputs(self) -> list[float]:
        return [run.throughput for run in self.runs if run.throughput is not None]

    @property
    def measured(self) -> bool:
        return bool(self.throughputs)

    @property
    def exit_code(self) -> int:
        """The first failing run's exit code, else 0."""
        return next((run.exit_code for run in self.runs if run.exit_code != 0), 0)

    @property
    def error(self) -> str:
        return next((run.error for run in self.runs if run.error), "")

    @property
    def low(self) -> float:
        return min(self.throughputs)

    @property
    def median(self) -> float:
        return statistics.median(self.throughputs)

    @property
    def high(self) -> float:
        return max(self.throughputs)

    def overlaps(self, other: Trial) -> bool:
        """Whether the two spreads overlap: a tie, within the noise."""
        return self.low <= other.high and other.low <= self.high

    def to_json(self) -> dict[str, Any]:
        runs = [{"seconds": r.seconds, "exit_code": r.exit_code, "throughput": r.throughput, "error": r.error}
                for r in self.runs]
        return {**self.setting.to_json(), "seconds": [run.seconds for run in self.runs],
                "throughput": self.median if self.measured else None, "throughputs": self.throughputs,
                "exit_code": self.exit_code, "error": self.error or None, "runs": runs}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        return cls(Setting.from_json(data), tuple(Run(**run) for run in data["runs"]))


@dataclass(frozen=True, slots=True)
class TuneResult:
    """The trials (in the grid's order), the settings the budget left out, and the signal that stopped it."""

    job: TuneJob
    trials: tuple[Trial, ...]
    dropped: tuple[Setting, ...] = ()
    interrupted: int | None = None
    elapsed: float = 0.0

    @property
    def _ranked(self) -> list[Trial]:
        """The measured settings, highest median throughput first."""
        return sorted((t for t in self.trials if t.measured), key=lambda t: t.median, reverse=True)

    @property
    def best(self) -> Trial | None:
        """The setting of the highest median throughput."""
        return self._ranked[0] if self._ranked else None

    @property
    def next_best(self) -> Trial | None:
        return self._ranked[1] if len(self._ranked) > 1 else None

    @property
    def ties(self) -> list[Trial]:
        """The settings whose spread overlaps the best one's."""
        best = self.best
        return [t for t in self._ranked[1:] if best is not None and t.overlaps(best)]

    @property
    def baseline(self) -> Trial | None:
        """One rank (without MPS when measured so), else the best's rank count without MPS; None if neither ran."""
        measured = self._ranked
        for candidates in ([t for t in measured if t.setting.ranks == 1],
                           [t for t in measured if self.best and t.setting.ranks == self.best.setting.ranks]):
            if candidates:
                return next((t for t in candidates if t.setting.mps == "off"), candidates[0])
        return None

    @property
    def beats_baseline(self) -> bool:
        """Whether the best setting's whole spread lies above the baseline's."""
        best, baseline = self.best, self.baseline
        return best is not None and baseline is not None and best is not baseline and best.low > baseline.high

    @property
    def recommended(self) -> Trial | None:
        """The best setting when it beats the baseline beyond the noise; otherwise the baseline."""
        if self.beats_baseline or self.baseline is None:
            return self.best
        return self.baseline

    def command_line(self, setting: Setting) -> str:
        """The command that runs ``setting`` as its trials ran: no trial had the caller's MPSRUN_QUEUES, so one
        without --queues runs without it too."""
        return self.job.command_line(setting, ("MPSRUN_QUEUES",) if setting.queues is None else ())

    def to_json(self) -> dict[str, Any]:
        chosen = self.recommended
        baseline = self.baseline
        return {"trials": [t.to_json() for t in self.trials], "best": chosen.to_json() if chosen else None,
                "command": self.command_line(chosen.setting) if chosen else None,
                "baseline": baseline.to_json() if baseline else None, "beats_baseline": self.beats_baseline,
                "scaling": "metric" if self.job.metric else self.job.scaling,
                "dropped": [s.to_json() for s in self.dropped], "interrupted": self.interrupted,
                "elapsed": self.elapsed, "job": {"command": list(self.job.command), "options": list(self.job.options),
                                                 "scaling": self.job.scaling, "metric": self.job.metric,
                                                 "tasks": self.job.tasks}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TuneResult:
        """A result saved with :meth:`to_json` (``mpsrun tune --json``), to report or plot again."""
        job = TuneJob(tuple(data["job"]["command"]), tuple(data["job"]["options"]), data["job"]["scaling"],
                      data["job"]["metric"], data["job"].get("tasks"))
        dropped = tuple(Setting.from_json(setting) for setting in data["dropped"])
        return cls(job, tuple(Trial.from_json(t) for t in data["trials"]), dropped, data["interrupted"],
                   data["elapsed"])
