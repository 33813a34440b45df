"""The settings ``mpsrun tune`` tries: rank counts, MPS on or off, thread percentages, and the job around them.

A :class:`Setting` is one point of the grid; :class:`TuneJob` is what every trial shares (the command, the job
options given, how throughput is counted). Everything here is checked before any trial runs: a bad value is a
:class:`~mpsrun.errors.ConfigError` (one line, exit 2).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpsrun.config import values
from mpsrun.config.commandline import parse_args, parse_options, split_argv
from mpsrun.errors import ConfigError, GPUError

__all__ = ["QUEUES_VARIABLE", "SCALINGS", "Setting", "TuneJob", "default_ranks", "grid", "parse_mps_list",
           "parse_queues_list", "parse_ranks_list", "parse_thread_list"]

SCALINGS = ("weak", "strong")
#: Options each trial sets itself (by name in the job's configuration, and as written): the job options given to
#: tune must leave them to it; what to give tune instead.
_TUNED = {"nranks": ("-np", "--ranks"), "mps": ("--mps", "--mps"),
          "thread_percentage": ("--thread-percentage", "--thread-percentage"), "queues": ("--queues", "--queues")}
#: Variables for the tuned options: a trial's own options decide, so the caller's are not passed on.
TUNED_VARIABLES = ("MPSRUN_NP", "MPSRUN_MPS", "MPSRUN_THREAD_PERCENTAGE", "MPSRUN_QUEUES")
#: Each rank's hardware work queues, which ``--queues`` sets (tune tries counts of them as that option).
QUEUES_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


@dataclass(frozen=True, slots=True)
class Setting:
    """One point of the grid. ``thread_percentage`` None: not set (MPS's default, every SM); ``queues`` None: each
    rank's hardware queues not set (MPS's default, or the caller's CUDA_DEVICE_MAX_CONNECTIONS)."""

    ranks: int
    mps: str
    thread_percentage: str | None = None
    queues: values.Queues = None

    def options(self) -> list[str]:
        """The mpsrun options that make a job of this setting."""
        tp = [] if self.thread_percentage is None else ["--thread-percentage", self.thread_percentage]
        queues = [] if self.queues is None else ["--queues", str(self.queues)]
        return ["-np", str(self.ranks), "--mps", self.mps, *tp, *queues]

    def label(self) -> str:
        return " ".join(self.options())

    def to_json(self) -> dict[str, object]:
        return {"ranks": self.ranks, "mps": self.mps, "thread_percentage": self.thread_percentage,
                "queues": str(self.queues) if self.queues == values.AUTO else self.queues}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Setting:
        """A setting :meth:`to_json` wrote."""
        queues = data["queues"]
        return cls(data["ranks"], data["mps"], data["thread_percentage"],
                   None if queues is None else values.parse_queues(queues))


@dataclass(frozen=True, slots=True)
class TuneJob:
    """What every trial shares: the command, the job options given to tune, and how throughput is counted
    (``scaling``; or ``metric``, a regular expression whose first group, else whole match, is a number each
    rank prints; of a farm, its ``tasks`` per second)."""

    command: tuple[str, ...]
    options: tuple[str, ...] = ()
    scaling: str = "weak"
    metric: str | None = None
    tasks: int | None = None  # a farm's (--tasks, --array): how many tasks each trial runs

    def __post_init__(self) -> None:
        if not all(isinstance(word, str) for word in (*self.command, *self.options)):
            raise ConfigError("the command and the job options are lists of strings", setting="command")
        if not self.command and "-m" not in self.options and self.tasks is None:
            raise ConfigError("no command given: mpsrun tune [options] -- command [args...]", setting="command")
        values.parse_choice(self.scaling, SCALINGS, "--scaling")
        if self.metric is not None:
            if not self.metric.strip():  # it matches anything, and so finds no number
                raise ConfigError("--metric needs a regular expression for a number each rank prints, such as "
                                  r"'items/s: (\S+)'", setting="--metric", value=self.metric)
            try:
                re.compile(self.metric)
            except (re.error, TypeError) as exc:
                raise ConfigError(f"--metric: not a regular expression: {exc}", setting="--metric",
                                  value=self.metric) from None
        self._check_options()

    def _check_options(self) -> None:
        """The job options must leave tune's settings to it, and be what mpsrun itself would take (in the
        environment the trials get)."""
        environ = {name: value for name, value in os.environ.items() if name not in TUNED_VARIABLES}
        try:
            given = parse_options(split_argv([*self.options, "--", "true"])[0], environ={})
            per_node = parse_args(self._words(), environ=environ).per_node
        except SystemExit:  # --help or --version among the job options
            raise ConfigError("--help and --version are not job options", setting="command line") from None
        for name, (flag, instead) in _TUNED.items():
            if name in given:
                raise ConfigError(f"mpsrun tune sets {flag} in each trial: give {instead} to tune "
                                  "instead", setting=flag)
        if "dry_run" in given:
            raise ConfigError("--dry-run starts nothing, so there is nothing to measure: run mpsrun --dry-run alone",
                              setting="--dry-run")
        if any(export.partition("=")[0] == QUEUES_VARIABLE for export in given.get("exports", ())):
            raise ConfigError(f"give the hardware queues to tune as --queues, not as -x {QUEUES_VARIABLE}",
                              setting="-x")
        if per_node:
            raise ConfigError("--per-node runs under a launcher of your own: tune runs whole jobs (use --hosts or "
                              "--launcher)", setting="--per-node")

    def _words(self, setting: Setting | None = None) -> list[str]:
        """The job's words after tune's own options: job options, then the command (``-m MODULE`` ends them)."""
        tail = ["--", *self.command] if self.command else []
        return [*(setting.options() if setting else []), *self.options, *tail]

    def argv(self, setting: Setting) -> list[str]:
        """The mpsrun command line (without the program that runs mpsrun) of one trial."""
        tag = ["--tag-output"] if self.metric is not None else []
        return [*setting.options(), *tag, *self._words()]

    def command_line(self, setting: Setting, unset: Sequence[str] = ()) -> str:
        """The command a user runs to get ``setting``, as a shell would take it; ``unset``: variables the trials ran
        without, which the command then runs without too (``env -u``) where this shell has them."""
        dropped = [word for name in unset if name in os.environ for word in ("-u", name)]
        return shlex.join([*(["env", *dropped] if dropped else []), "mpsrun", *self._words(setting)])


def farm_size(command: Sequence[str], options: Sequence[str]) -> int | None:
    """How many tasks a farm's trial runs (None: the job is no farm). ``--tasks -`` is refused: each trial reads the
    task list again, and standard input is read once."""
    from mpsrun.config.commandline import parse_args
    from mpsrun.farm.tasks import farm_tasks
    from mpsrun.runtime.deadline import Deadline

    try:
        config = parse_args([*options, *(["--", *command] if command else [])], environ={})
    except SystemExit:  # --help or --version among the job options: said by the options' own check
        return None
    if not config.farm:
        return None
    if config.tasks == "-":
        raise ConfigError("mpsrun tune runs the farm once per trial: give --tasks a file, not - (standard input)",
                          setting="--tasks")
    tasks, done = farm_tasks(config, Deadline(config.timeout))
    return sum(done.get(task.id) != task.argv for task in tasks) or 1


def parse_ranks_list(text: str) -> tuple[int, ...]:
    """``1,2,4,8``: rank counts, each as ``-np`` takes it."""
    return tuple(dict.fromkeys(values.parse_ranks(part.strip(), setting="--ranks") for part in _items(text, "--ranks")))


def parse_thread_list(text: str) -> tuple[str | None, ...]:
    """``none,auto,50``: thread percentages (``none``: not set), each as ``--thread-percentage`` takes one."""
    found: list[str | None] = []
    for part in _items(text, "--thread-percentage"):
        word = part.strip().lower()
        if word == "none":
            found.append(None)
        else:
            found.append(str(values.parse_thread_spec(word, setting="--thread-percentage")))
    return tuple(dict.fromkeys(found))


def parse_queues_list(text: str) -> tuple[values.Queues, ...]:
    """``default,auto,2,8``: hardware work queues per rank, each as ``--queues`` takes one (``default``: not set)."""
    found: list[values.Queues] = []
    for part in _items(text, "--queues"):
        word = part.strip().lower()
        found.append(None if word == "default" else values.parse_queues(word, "--queues"))
    return tuple(dict.fromkeys(found))


def parse_mps_list(text: str) -> tuple[str, ...]:
    """``on,off``: MPS modes, each as ``--mps`` takes one."""
    return tuple(dict.fromkeys(values.parse_choice(part.strip().lower(), ("on", "off", "auto"), "--mps")
                               for part in _items(text, "--mps")))


def _items(text: str, setting: str) -> list[str]:
    parts = text.split(",")
    if not text.strip() or any(not part.strip() for part in parts):
        raise ConfigError(f"{setting} takes a list separated by commas, not {text!r}", setting=setting, value=text)
    return parts


def default_ranks(options: Sequence[str], environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """1, then 1, 2, 4 and 8 ranks per GPU the job would use (its ``--gpus``, else the GPUs visible here)."""
    gpus = parse_args([*options, "--", "true"], environ=os.environ if environ is None else environ).gpus
    count = len(gpus) if gpus else _visible_gpus()
    return tuple(dict.fromkeys([1, *(per_gpu * count for per_gpu in (1, 2, 4, 8))]))


def _visible_gpus() -> int:
    from mpsrun.mps import gpus as gpu_info

    try:
        return max(1, len(gpu_info.visible_gpus()))
    except GPUError:
        return 1


def grid(ranks: Sequence[int], mps: Sequence[str], thread_percentages: Sequence[str | None],
         queues: Sequence[values.Queues] = (None,)) -> list[Setting]:
    """Every combination, fewest ranks first; without MPS a thread percentage and a queue count mean nothing to
    mpsrun (a process outside MPS has CUDA's 8 queues), so each is tried once."""
    settings: list[Setting] = []
    for count in sorted(ranks):
        for mode in mps:
            for spec in thread_percentages if mode != "off" else (None,):
                settings += [Setting(count, mode, spec, each) for each in (queues if mode != "off" else (None,))]
    return list(dict.fromkeys(settings))
