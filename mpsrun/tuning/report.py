"""How ``mpsrun tune`` tells what it measured: a table of every setting's spread, the recommendation as the
command line to run with its gains, plain words when nothing beat the baseline, and a figure (``--plot``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from mpsrun.errors import ConfigError, MPSError
from mpsrun.tools.plotting import pyplot
from mpsrun.tuning.results import Trial, TuneResult

__all__ = ["check_plot_path", "format_report", "plot"]


def _unit(result: TuneResult) -> str:
    job = result.job
    if job.tasks is not None:
        return f"tasks / farm seconds (each trial runs the farm's {job.tasks} task(s); ranks are its slots)"
    if job.metric is not None:
        return f"the sum over ranks of --metric {job.metric!r}"
    if job.scaling == "weak":
        return "ranks / job seconds (weak scaling: each rank does the command's whole work)"
    return "1 / job seconds (strong scaling: the job's work is fixed)"


def _note(result: TuneResult, trial: Trial) -> str:
    if not trial.measured:
        return f"failed: exit {trial.exit_code}" + (f" ({trial.error})" if trial.error else "")
    notes = []
    if trial is result.best:
        notes.append("best")
    elif trial in result.ties:
        notes.append("tie with the best")
    if trial is result.baseline:
        notes.append("baseline")
    if trial.exit_code:
        notes.append(f"{len(trial.runs) - len(trial.throughputs)} run(s) failed: exit {trial.exit_code}")
    return ", ".join(notes)


def _rows(result: TuneResult) -> list[str]:
    baseline = result.baseline
    header = f"{'ranks':>5}  {'mps':<4} {'thread %':<9} {'queues':<6} {'median s':>9}  " \
             f"{'throughput min / median / max':<32} {'vs baseline':>11}  note"
    lines = [header]
    for trial in result.trials:
        setting = trial.setting
        seconds = sorted(run.seconds for run in trial.runs)
        spread = f"{trial.low:.4g} / {trial.median:.4g} / {trial.high:.4g}" if trial.measured else "-"
        ratio = f"{trial.median / baseline.median:.2f}x" if trial.measured and baseline else "-"
        queues = "-" if setting.mps == "off" else str(setting.queues or "default")
        lines.append(f"{setting.ranks:>5}  {setting.mps:<4} {setting.thread_percentage or '-':<9} {queues:<6} "
                     f"{seconds[len(seconds) // 2]:>9.3f}  {spread:<32} {ratio:>11}  {_note(result, trial)}")
    return lines


def _verdict(result: TuneResult) -> list[str]:
    best, baseline, chosen = result.best, result.baseline, result.recommended
    if best is None or chosen is None:
        if any(t.runs for t in result.trials):
            return ["nothing could be measured: every trial failed (see the notes above)"]
        why = "it was interrupted" if result.interrupted is not None else "the budget left out every setting"
        return [f"nothing was measured: {why}"]
    run = f"run: {result.command_line(chosen.setting)}"
    if baseline is None or best is baseline:
        lines = [run, f"  the baseline ({best.setting.label()}) is the best measured"]
    elif not result.beats_baseline:
        return [f"nothing beats the baseline ({baseline.setting.label()}) beyond the noise: the best, "
                f"{best.setting.label()}, measured {best.median / baseline.median:.2f}x, within the baseline's "
                "spread; so", run]
    else:
        lines = [run, f"  {best.median / baseline.median:.2f}x the baseline ({baseline.setting.label()})"]
    after = result.next_best
    if after is not None and after is not baseline:
        tie = " (a tie: their spreads overlap)" if after in result.ties else ""
        lines.append(f"  {best.median / after.median:.2f}x the next best ({after.setting.label()}){tie}")
    return lines


def format_report(result: TuneResult, repeats: int) -> str:
    """The table and the recommendation, as printed."""
    lines = [f"mpsrun tune: {len(result.trials)} setting(s), up to {repeats} run(s) each, in {result.elapsed:.0f} s; "
             f"throughput: {_unit(result)}", *_rows(result), ""]
    if result.dropped:
        lines.append(f"not measured (budget or interruption): {'; '.join(s.label() for s in result.dropped)}")
    if result.interrupted is not None:
        lines.append(f"interrupted by {signal.Signals(result.interrupted).name}: what was measured until then")
    return "\n".join([*lines, *_verdict(result)])


def check_plot_path(path: str) -> None:
    """Refuse, before anything runs, a --plot that could not be drawn: no matplotlib, a format it does not write,
    or a directory that is not there or not ours to write."""
    if not path:
        raise ConfigError("--plot needs a file name (FILE.png)", setting="--plot")
    try:
        plt = pyplot()
    except MPSError as exc:
        raise ConfigError(str(exc), setting="--plot") from None
    kinds = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in kinds:
        raise ConfigError(f"--plot {path}: name a file ending in one of .{', .'.join(sorted(kinds))}", setting="--plot")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ConfigError(f"--plot {path}: {directory} is not a directory this user can write", setting="--plot")


def plot(result: TuneResult, path: str) -> None:
    """Each measured setting's median throughput, with its min-max spread as a bar."""
    plt = pyplot()
    measured: Sequence[Trial] = [t for t in result.trials if t.measured]
    figure, axis = plt.subplots(figsize=(max(5.0, 0.7 * len(measured) + 2), 4))
    medians = [t.median for t in measured]
    spread = [[t.median - t.low for t in measured], [t.high - t.median for t in measured]]
    colours = ["tab:green" if t is result.recommended else "tab:grey" if t is result.baseline else "tab:blue"
               for t in measured]
    axis.bar(range(len(measured)), medians, yerr=spread, capsize=4, color=colours)
    axis.set_xticks(range(len(measured)), [t.setting.label().replace(" --", "\n--") for t in measured], fontsize=7)
    axis.set_ylabel("throughput (median; bars: min-max)")
    axis.set_title(f"mpsrun tune: {' '.join(result.job.command)[:60]}", fontsize=9)
    figure.tight_layout()
    try:
        figure.savefig(path)
    except (OSError, ValueError) as exc:
        raise MPSError(f"--plot {path}: {exc}") from None
    finally:
        plt.close(figure)
