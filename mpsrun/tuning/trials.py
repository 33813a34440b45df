"""Running ``mpsrun tune``'s trials: each one a real ``mpsrun`` job of the user's command, timed from its start
to its end, its output kept aside (read for ``--metric``), and nothing of it left when it ends.

The schedule warms up once (not counted), then runs every setting once per repeat, in the grid's order on even
repeats and the reverse on odd ones, so a drift of the machine (clocks, temperature) falls on every setting
alike. With a budget, the settings it cannot reach are left out before they start, and said.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from mpsrun.errors import CommandNotExecutableError, CommandNotFoundError, ConfigError, InterruptionError, MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.processes import own_module
from mpsrun.tuning.grid import TUNED_VARIABLES, Setting, TuneJob
from mpsrun.tuning.results import Run, Trial, TuneResult

__all__ = ["Schedule", "run_trial"]

_TAGGED = re.compile(r"\[rank (\d+)\] (.*)")
#: A warm-up that ends so cannot run the command at all (not found, not executable, or mpsrun refused the job's
#: options, such as a GPU that is not there): tune stops there.
_CANNOT_RUN = {ExitCode.NOT_FOUND: CommandNotFoundError, ExitCode.NOT_EXECUTABLE: CommandNotExecutableError,
               ExitCode.USAGE: ConfigError}


_TAIL = 64 << 10  # what is read of a failed trial's stderr: its last lines say why


def _why(stderr: IO[bytes]) -> str:
    """A failed job's own last line (mpsrun's summary), and the program's last line before it."""
    stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - _TAIL))
    lines = [line.strip() for line in stderr.read().decode(errors="replace").splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("mpsrun:")]
    theirs = [line for line in lines if not line.startswith("mpsrun:")]
    summary = ours[-1].removeprefix("mpsrun:").strip().removeprefix("error:").strip() if ours else ""
    return "; ".join(part for part in (summary, f"last output line: {theirs[-1][:200]}" if theirs else "") if part)


def _number(match: re.Match[str]) -> float | None:
    """The match's first group (else the whole match) as a finite number; None if it is none."""
    text = match.group(1) if match.re.groups else match.group(0)
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def metric_total(lines: Iterable[str], pattern: str, ranks: int) -> tuple[float | None, str]:
    """The sum over ranks of the number each rank printed last that ``pattern`` matches (its first group, else the
    whole match; finite numbers only), from tagged output lines; None and why, if a rank printed none."""
    regex = re.compile(pattern)
    found: dict[int, float] = {}
    for line in lines:
        tagged = _TAGGED.match(line)
        match = regex.search(tagged.group(2)) if tagged else None
        value = _number(match) if tagged and match else None
        if tagged and value is not None:
            found[int(tagged.group(1))] = value
    missing = [rank for rank in range(ranks) if rank not in found]
    if missing:
        return None, f"no number matching --metric in the output of rank(s) {', '.join(map(str, missing))}"
    return sum(found.values()), ""


def _throughput(job: TuneJob, setting: Setting, seconds: float, stdout: IO[bytes]) -> tuple[float | None, str]:
    if job.metric is not None:
        stdout.seek(0)
        lines = (line.decode(errors="replace").rstrip("\n") for line in stdout)  # line by line: output may be large
        return metric_total(lines, job.metric, setting.ranks)
    if job.tasks is not None:
        return job.tasks / seconds, ""
    return (setting.ranks if job.scaling == "weak" else 1) / seconds, ""


def run_trial(job: TuneJob, setting: Setting, env: Mapping[str, str]) -> Run:
    """Run one job of ``setting`` and time it (its output is kept only for ``--metric``, its errors for why it
    failed). A stopping signal is passed on to the job, which ends cleanly, and then raised again."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.monotonic()
        process = subprocess.Popen([*own_module("mpsrun.cli"), *job.argv(setting)], stderr=stderr,
                                   stdout=stdout if job.metric is not None else subprocess.DEVNULL,
                                   stdin=subprocess.DEVNULL, env=dict(env))
        try:
            code = process.wait()
        except BaseException as exc:
            signal_number = exc.signal if isinstance(exc, InterruptionError) else signal.SIGINT
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
    bounds the whole: in the first round each setting is started only if all its repeats still fit, as far as
    the runs so far tell, and the budget ends any round early."""

    job: TuneJob
    settings: Sequence[Setting]
    repeats: int = 3
    budget: float | None = None
    progress: Callable[[str], object] | None = None

    def __post_init__(self) -> None:
        self._env = {name: value for name, value in os.environ.items() if name not in TUNED_VARIABLES}
        self._runs: dict[Setting, list[Run]] = {setting: [] for setting in self.settings}
        self._done, self._planned = 0, self.repeats * len(self.settings)
        self._start = time.monotonic()
        self._warm = Run(0.0, 0, None)

    def run(self) -> TuneResult:
        """Warm up, then every round; the trials (what was measured, also when a signal stopped it)."""
        self._start = time.monotonic()
        interrupted: int | None = None
        try:
            with Interrupts():
                self._warm = run_trial(self.job, self.settings[0], self._env)
                if self._warm.throughput is None:  # every trial would only fail as it did
                    raise self._warm_up_failed()
                self._say(f"warm-up ({self.settings[0].label()}): {self._warm.seconds:.2f} s, not counted")
                self._rounds()
        except InterruptionError as exc:  # what was measured so far still counts
            interrupted = exc.signal
        trials = tuple(Trial(setting, tuple(done)) for setting, done in self._runs.items() if done)
        left_out = tuple(setting for setting, done in self._runs.items() if not done)
        return TuneResult(self.job, trials, left_out, interrupted, time.monotonic() - self._start)

    def _warm_up_failed(self) -> MPSError:
        """Why tune stops before its trials: the warm-up's job could not run, failed, or printed no --metric."""
        warm, label = self._warm, self.settings[0].label()
        if warm.exit_code in _CANNOT_RUN:
            error: MPSError = _CANNOT_RUN[warm.exit_code](f"the warm-up could not run the job: {warm.error}")
            return error
        what = f"failed (exit {warm.exit_code})" if warm.exit_code else "gave no throughput"
        return MPSError(f"the warm-up ({label}) {what}: {warm.error or 'nothing said'}; no trial was run")

    def _rounds(self) -> None:
        kept: list[Setting] = []
        for setting in self.settings:  # the first round, fewest ranks first: what is learnt prices the next
            if self._fits(setting, kept):
                kept.append(setting)
                self._trial(setting)
            else:
                self._planned -= self.repeats
                self._say(f"the budget of {self.budget:g} s leaves out {setting.label()}")
        for repeat in range(1, self.repeats if kept else 1):
            for setting in kept if repeat % 2 == 0 else kept[::-1]:
                if not self._fits(setting):
                    self._say(f"budget of {self.budget:g} s reached after {self._done} trials")
                    return
                self._trial(setting)

    def _trial(self, setting: Setting) -> None:
        run = run_trial(self.job, setting, self._env)
        self._runs[setting].append(run)
        self._done += 1
        outcome = f"{run.seconds:.2f} s" if run.exit_code == 0 else f"failed, exit {run.exit_code}"
        left = self._estimate(setting) * (self._planned - self._done)
        self._say(f"trial {self._done} of {self._planned} ({setting.label()}): {outcome}; "
                  f"{_clock(time.monotonic() - self._start)} elapsed, about {_clock(left)} left")

    def _fits(self, setting: Setting, kept: Sequence[Setting] | None = None) -> bool:
        """Whether one more run of ``setting`` fits the budget; with ``kept`` (in the first round: the settings
        kept so far), all its repeats and the repeats still to come of those."""
        if self.budget is None:
            return True
        more = self._estimate(setting)
        if kept is not None:
            more += (self.repeats - 1) * (more + sum(self._estimate(s) for s in kept))
        return time.monotonic() - self._start + more <= self.budget

    def _estimate(self, setting: Setting) -> float:
        """Seconds one job of ``setting`` should take: its slowest run so far; else the slowest run of the most
        ranks below it (the same MPS mode first, else the warm-up), scaled by ranks when each rank does the whole
        work (as if the GPU ran no two ranks at once)."""
        if self._runs[setting]:
            return max(run.seconds for run in self._runs[setting])
        below = [s for s in self._runs if self._runs[s] and s.ranks <= setting.ranks]
        below.sort(key=lambda s: (s.mps == setting.mps, s.ranks))
        known = (below[-1].ranks, self._estimate(below[-1])) if below else (self.settings[0].ranks, self._warm.seconds)
        weak = self.job.scaling == "weak" or self.job.metric is not None
        return known[1] * (setting.ranks / known[0] if weak else 1.0)

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(f"mpsrun tune: {line}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
