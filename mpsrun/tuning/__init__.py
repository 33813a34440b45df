"""``mpsrun tune``: measure the user's own job under candidate settings and say which to run.

Owns: the settings tried (:mod:`~mpsrun.tuning.grid`), running and timing the trials as real mpsrun jobs
(:mod:`~mpsrun.tuning.trials`), what they show (:mod:`~mpsrun.tuning.results`), how it is told
(:mod:`~mpsrun.tuning.report`) and its command line (:mod:`~mpsrun.tuning.cli`). :func:`tune` is the
Python API (``mpsrun.tune``).

Imports: the configuration (to check every setting before anything runs), :mod:`mpsrun.mps` (whether MPS can run
here at all, and the GPUs for the default rank counts), the runtime, and :mod:`mpsrun.tools.plotting` for
``--plot``, and a farm's task list (:mod:`mpsrun.farm.tasks`: its tasks are counted). Each trial is a separate
``mpsrun`` process: neither :mod:`mpsrun.job` nor :mod:`mpsrun.session` is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpsrun.config import values
from mpsrun.errors import ConfigError, MPSError, MPSUnavailableError
from mpsrun.mps import gpus
from mpsrun.mps.daemon import unavailable_reason
from mpsrun.tuning.grid import (
    Setting,
    TuneJob,
    default_ranks,
    farm_size,
    grid,
    parse_mps_list,
    parse_queues_list,
    parse_ranks_list,
    parse_thread_list,
)
from mpsrun.tuning.results import Run, Trial, TuneResult
from mpsrun.tuning.trials import Schedule

__all__ = ["Run", "Trial", "TuneResult", "tune"]

Values = str | Sequence[object]


MAX_REPEATS = 1000


def _text(items: Values | int | None, setting: str, unset: str = "none") -> str:
    """A list as the command line writes it (``1,2,4``; None as ``unset``, the list's word for not set); a single
    value is a list of one."""
    if isinstance(items, str):
        return items
    if items is None or isinstance(items, (int, float)):
        items = [items]
    if not isinstance(items, Sequence):
        raise ConfigError(f"{setting} takes a list or text like '1,2,4', not {items!r}", setting=setting)
    return ",".join(unset if item is None else str(item) for item in items)


def _strings(words: Sequence[str], setting: str) -> tuple[str, ...]:
    if isinstance(words, str) or not all(isinstance(word, str) for word in words):
        raise ConfigError(f"{setting} is a list of strings (['python3', 'sim.py']), not {words!r}", setting=setting)
    return tuple(words)


def _runnable(settings: list[Setting], progress: Callable[[str], object] | None) -> list[Setting]:
    """The settings that can run here: without a driver or the MPS control program, those with MPS on are left out,
    and said (each would only fail as the first did)."""
    if not any(setting.mps == "on" for setting in settings):
        return settings
    reason = unavailable_reason("on")
    if reason is None:
        try:
            gpus.driver_info()
        except MPSError as exc:
            reason = exc.message
    if reason is None:
        return settings
    kept = [setting for setting in settings if setting.mps != "on"]
    if not kept:
        raise MPSUnavailableError(f"every setting asks for MPS, which cannot run here: {reason}", reason=reason)
    if progress is not None:
        progress(f"mpsrun tune: the settings with --mps on are left out: MPS cannot run here: {reason}")
    return kept


def tune(command: Sequence[str], *, ranks: Values | int | None = None, thread_percentage: Values | int = "none",
         mps: Values = "on,off", queues: Values | int | None = "default", repeats: int | str = 3,
         budget: float | str | None = None, scaling: str = "weak", metric: str | None = None,
         options: Sequence[str] = (), progress: Callable[[str], object] | None = None) -> TuneResult:
    """Run ``command`` as mpsrun jobs, one per combination of ``ranks`` x ``mps`` x ``thread_percentage`` x
    ``queues`` (each rank's hardware queues as ``--queues`` sets them: ``"default,auto,8"``), each
    ``repeats`` times after one warm-up, with the mpsrun ``options`` given (``["--gpus", "0"]``) in every trial;
    the trials, the best setting and the one to run (:class:`TuneResult`).

    Lists are sequences or text as on the command line (``"1,2,4"``; a thread percentage of None or ``"none"``
    is unset, and so is a queue count of None or ``"default"``). ``ranks`` defaults to 1, then 1, 2, 4 and 8 per
    GPU. ``scaling`` ``"weak"``: throughput is ranks per second of the job; ``"strong"``: jobs per second;
    ``metric``: a regular expression for a number each rank prints, summed over ranks. A farm (``--tasks FILE`` or
    ``--array`` among the ``options``): tasks per second, ``ranks`` being its slots. ``budget``: seconds for all
    of it; what it cannot reach is left out.
    ``progress`` hears a line after each trial. A bad value raises :class:`~mpsrun.errors.ConfigError` before
    anything runs; a command that cannot run at all, the warm-up's error (exit 126 or 127).
    """
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress must be callable, not {progress!r}", setting="progress")
    if metric is not None and not isinstance(metric, str):
        raise ConfigError(f"--metric is a regular expression, not {metric!r}", setting="--metric")
    words, given = _strings(command, "command"), _strings(options, "options")
    job = TuneJob(words, given, scaling=values.parse_choice(scaling, ("weak", "strong"), "--scaling"), metric=metric,
                  tasks=farm_size(words, given))
    counts = parse_ranks_list(_text(ranks, "--ranks")) if ranks is not None else default_ranks(job.options)
    settings = grid(counts, parse_mps_list(_text(mps, "--mps")),
                    parse_thread_list(_text(thread_percentage, "--thread-percentage")),
                    parse_queues_list(_text(queues, "--queues", unset="default")))
    count = values.parse_count(repeats, "--repeats")
    if count > MAX_REPEATS:
        raise ConfigError(f"--repeats must be at most {MAX_REPEATS}, not {repeats!r}", setting="--repeats")
    seconds = None if budget is None else values.parse_seconds(budget, "--budget")
    return Schedule(job, _runnable(settings, progress), count, seconds, progress).run()
