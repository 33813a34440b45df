"""``mpsrun tune``: measure the user's own job under candidate settings and say which to run.

Owns: the settings tried (:mod:`~mpsrun.tuning.grid`), running and timing the trials as real mpsrun jobs
(:mod:`~mpsrun.tuning.trials`), what they show (:mod:`~mpsrun.tuning.results`), how it is told
(:mod:`~mpsrun.tuning.report`) and its command line (:mod:`~mpsrun.tuning.cli`). :func:`tune` is the
Python API (``mpsrun.tune``).

Imports: the configuration (to check every setting before anything runs) and the runtime; each trial is a
separate ``mpsrun`` process, so nothing of a job's machinery is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpsrun.config import values
from mpsrun.tuning.grid import TuneJob, default_ranks, grid, parse_mps_list, parse_ranks_list, parse_thread_list
from mpsrun.tuning.results import Run, Trial, TuneResult
from mpsrun.tuning.trials import Schedule

__all__ = ["Run", "Trial", "TuneResult", "tune"]

Values = str | Sequence[object]


def _text(items: Values) -> str:
    """A list as the command line writes it (``1,2,4``; None as ``none``)."""
    return items if isinstance(items, str) else ",".join("none" if item is None else str(item) for item in items)


def tune(command: Sequence[str], *, ranks: Values | None = None, thread_percentage: Values = "none",
         mps: Values = "on,off", repeats: int | str = 3, budget: float | str | None = None, scaling: str = "weak",
         metric: str | None = None, options: Sequence[str] = (),
         progress: Callable[[str], object] | None = None) -> TuneResult:
    """Run ``command`` as mpsrun jobs, one per combination of ``ranks`` x ``mps`` x ``thread_percentage``, each
    ``repeats`` times after one warm-up, with the mpsrun ``options`` given (``["--gpus", "0"]``) in every trial;
    the trials, the best setting and the one to run (:class:`TuneResult`).

    Lists are sequences or text as on the command line (``"1,2,4"``; a thread percentage of None or ``"none"``
    is unset). ``ranks`` defaults to 1, then 1, 2, 4 and 8 per GPU. ``scaling`` ``"weak"``: throughput is ranks
    per second of the job; ``"strong"``: jobs per second; ``metric``: a regular expression for a number each
    rank prints, summed over ranks. ``budget``: seconds for all of it; what it cannot reach is left out.
    ``progress`` hears a line after each trial. A bad value raises :class:`~mpsrun.errors.ConfigError` before
    anything runs.
    """
    job = TuneJob(tuple(command), tuple(options), scaling=values.parse_choice(scaling, ("weak", "strong"),
                                                                            "--scaling"), metric=metric)
    counts = parse_ranks_list(_text(ranks)) if ranks is not None else default_ranks(job.options)
    settings = grid(counts, parse_mps_list(_text(mps)), parse_thread_list(_text(thread_percentage)))
    schedule = Schedule(job, settings, values.parse_count(repeats, "--repeats"),
                        None if budget is None else values.parse_seconds(budget, "--budget"), progress)
    return schedule.run()
