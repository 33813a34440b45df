"""Running ``mpsrun tune``'s trials: each one a real ``mpsrun`` job of the user's command, timed from its start
to its end, its output kept aside (read for ``--metric``), and nothing of it left when it ends.

The schedule warms up once (not counted), then runs every setting once per repeat, in the grid's order on even
repeats and the reverse on odd ones, so a drift of the machine (clocks, temperature) falls on every setting
alike. With a budget, the settings it cannot reach are left out before they start, and said.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from mpsrun.errors import InterruptionError
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.processes import own_module
from mpsrun.tuning.grid import TUNED_VARIABLES, Setting, TuneJob
from mpsrun.tuning.results import Run, Trial, TuneResult

__all__ = ["Schedule", "run_trial"]

_TAGGED = re.compile(r"\[rank (\d+)\] (.*)")


def _why(stderr: IO[bytes]) -> str:
    """A failed job's own last line (mpsrun's summary), and the program's last line before it."""
    stderr.seek(0)
    lines = [line.strip() for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("mpsrun:")]
    theirs = [line for line in lines if not line.startswith("mpsrun:")]
    summary = ours[-1].removeprefix("mpsrun:").strip().removeprefix("error:").strip() if ours else ""
    return "; ".join(part for part in (summary, f"last output line: {theirs[-1]}" if theirs else "") if part)


def metric_total(output: str, pattern: str, ranks: int) -> tuple[float | None, str]:
    """The sum over ranks of the number each rank printed last that ``pattern`` matches (its first group, else the
    whole match); None and why, if a rank printed none."""
    regex = re.compile(pattern)
    found: dict[int, float] = {}
    for line in output.splitlines():
        tagged = _TAGGED.match(line)
        match = regex.search(tagged.group(2)) if tagged else None
        if tagged and match:
            with contextlib.suppress(ValueError, IndexError):
                found[int(tagged.group(1))] = float(match.group(1) if regex.groups else match.group(0))
    missing = [rank for rank in range(ranks) if rank not in found]
    if missing:
        return None, f"no number matching --metric in the output of rank(s) {', '.join(map(str, missing))}"
    return sum(found.values()), ""


def _throughput(job: TuneJob, setting: Setting, seconds: float, stdout: IO[bytes]) -> tuple[float | None, str]:
    if job.metric is not None:
        stdout.seek(0)
        return metric_total(stdout.read().decode(errors="replace"), job.metric, setting.ranks)
    return (setting.ranks if job.scaling == "weak" else 1) / seconds, ""


def run_trial(job: TuneJob, setting: Setting, env: Mapping[str, str]) -> Run:
    """Run one job of ``setting`` and time it. A stopping signal is passed on to the job, which ends cleanly,
    and then raised again."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.monotonic()
        process = subprocess.Popen([*own_module("mpsrun.cli"), *job.argv(setting)], stdout=stdout, stderr=stderr,
                                   stdin=subprocess.DEVNULL, env=dict(env))
        try:
            code = process.wait()
        except BaseException as exc:
            signal_number = exc.signal if isinstance(exc, InterruptionError) else 2
            with contextlib.suppress(ProcessLookupError):  # our own child, by pid; the job stops its ranks
                process.send_signal(signal_number)
            process.wait()
            raise
        seconds = time.monotonic() - start
        if code != 0:
            return Run(seconds, code, None, _why(stderr))
        value, why = _throughput(job, setting, seconds, stdout)
        return Run(seconds, code, value, why)


@dataclass
class Schedule:
    """The trials of one tuning, run in order. ``progress`` hears a line after each trial; ``budget`` (seconds)
    bounds the whole."""

    job: TuneJob
    settings: Sequence[Setting]
    repeats: int = 3
    budget: float | None = None
    progress: Callable[[str], object] | None = None

    def run(self) -> TuneResult:
        env = {name: value for name, value in os.environ.items() if name not in TUNED_VARIABLES}
        start = time.monotonic()
        runs: dict[Setting, list[Run]] = {setting: [] for setting in self.settings}
        interrupted: int | None = None
        try:
            with Interrupts():
                warm = run_trial(self.job, self.settings[0], env)
                self._say(f"warm-up ({self.settings[0].label()}): {warm.seconds:.2f} s, not counted")
                dropped = self._over_budget(warm, start)
                self._repeat(runs, [s for s in self.settings if s not in dropped], warm, start, env)
        except InterruptionError as exc:  # what was measured so far still counts
            interrupted = exc.signal
        trials = tuple(Trial(setting, tuple(done)) for setting, done in runs.items() if done)
        left_out = tuple(setting for setting, done in runs.items() if not done)
        return TuneResult(self.job, trials, left_out, interrupted, time.monotonic() - start)

    def _repeat(self, runs: dict[Setting, list[Run]], settings: list[Setting], warm: Run, start: float,
                env: Mapping[str, str]) -> None:
        order = [s for repeat in range(self.repeats) for s in (settings if repeat % 2 == 0 else settings[::-1])]
        for number, setting in enumerate(order, 1):
            left = sum(self._estimate(s, runs, warm) for s in order[number - 1:])
            if self.budget is not None and time.monotonic() - start + self._estimate(setting, runs, warm) > self.budget:
                self._say(f"budget of {self.budget:g} s reached after {number - 1} of {len(order)} trials")
                return
            run = run_trial(self.job, setting, env)
            runs[setting].append(run)
            outcome = f"{run.seconds:.2f} s" if run.exit_code == 0 else f"failed, exit {run.exit_code}"
            self._say(f"trial {number} of {len(order)} ({setting.label()}): {outcome}; "
                      f"{_clock(time.monotonic() - start)} elapsed, about {_clock(max(0.0, left - run.seconds))} left")

    def _estimate(self, setting: Setting, runs: Mapping[Setting, list[Run]], warm: Run) -> float:
        """Seconds one job of ``setting`` should take: its slowest run so far, else the warm-up's, scaled by ranks
        when each rank does the whole work (as if the GPU gave them no concurrency at all)."""
        done = runs.get(setting)
        if done:
            return max(run.seconds for run in done)
        scale = setting.ranks / self.settings[0].ranks if self.job.scaling == "weak" or self.job.metric else 1.0
        return warm.seconds * max(1.0, scale)

    def _over_budget(self, warm: Run, start: float) -> list[Setting]:
        """The settings to leave out (most ranks first) so that every repeat of the rest fits the budget."""
        if self.budget is None:
            return []
        kept = list(self.settings)
        spent = time.monotonic() - start
        while len(kept) > 1 and spent + self.repeats * sum(self._estimate(s, {}, warm) for s in kept) > self.budget:
            kept.pop()
        dropped = [s for s in self.settings if s not in kept]
        if dropped:
            self._say(f"the budget of {self.budget:g} s leaves out: {'; '.join(s.label() for s in dropped)}")
        return dropped

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(f"mpsrun tune: {line}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
