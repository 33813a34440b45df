"""Every ``mpsrun`` option, declared once, and the job configuration they make.

Each field of :class:`JobConfig` carries its command-line declaration (its :class:`Option`, in its annotation, as
``Annotated`` metadata). From it come the parser
(:mod:`mpsrun.config.commandline`), the ``MPSRUN_<NAME>`` variable (named after the option's last
spelling: ``--mem-limit`` -> ``MPSRUN_MEM_LIMIT``, ``-np`` -> ``MPSRUN_NP``), and what node keepers and
per-node ranks are handed as data (:meth:`JobConfig.to_json`). A value is validated once, where it is
parsed (:mod:`mpsrun.config.values`).
"""

import functools
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, get_args

from mpsrun.config import values
from mpsrun.errors import ConfigError

__all__ = ["FARM_OPTIONS", "JobConfig", "Option", "differing_options", "option_variables", "options"]


class Option(NamedTuple):
    """How one setting is spelled and read. ``parse`` is None for an on/off switch."""

    flags: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    render: Callable[[Any], str] = str
    forward: bool = False  # a setting of every rank (per-node ranks and node keepers must agree on it)
    append: bool = False  # repeatable; the variable is split like a shell line
    env: bool = True

    @property
    def variable(self) -> str:
        return "MPSRUN_" + self.flags[-1].lstrip("-").upper().replace("-", "_")

    @property
    def takes_value(self) -> bool:
        return self.parse is not None or self.choices is not None


def option(*flags: str, help: str, **spec: Any) -> Option:
    return Option(flags, help, **spec)


def _validated(check: Callable[..., Any]) -> Callable[[str], Any]:
    """A validator as an argparse type (argparse names the option in its message)."""

    def parse(text: str) -> Any:
        try:
            return check(text, setting="value")
        except ConfigError as exc:
            import argparse  # only here: node keepers read a JobConfig, and parse no command line

            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def _executable(text: str, setting: str = "--mpiexec") -> str:
    """An executable, as given (checked once, here): Open MPI started by absolute path behaves as with ``--prefix``
    and puts its own directories first on the ranks' PATH, so a name stays a name."""
    if shutil.which(text) is None:
        raise ConfigError(f"{text!r} is not an executable", setting=setting, value=text)
    return text


def _seconds(allow_zero: bool) -> Callable[[str, str], float]:
    def parse(text: str, setting: str) -> float:
        return values.parse_seconds(text, setting, allow_zero)

    parse.__name__ = "seconds"
    return parse


def _joined(value: Sequence[Any] | None) -> str:
    return "all" if value is None else ",".join(map(str, value))


def _spec_text(value: values.ThreadSpec) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


class JobConfig(NamedTuple):
    """Everything that defines one ``mpsrun`` job (built with keywords)."""

    command: tuple[str, ...] = ()
    nranks: Annotated[int | None, option(
        "-n", "--np", "-np", parse=_validated(values.parse_ranks), metavar="N", forward=True,
        help="number of ranks (default 1; under --per-node: as the launcher started them)")] = None
    gpus: Annotated[values.GpuList, option(
        "--gpus", parse=_validated(values.parse_gpus), metavar="LIST", render=_joined, forward=True,
        help="GPUs to use: 0,1 or GPU- UUIDs, or all (default: all visible; honours CUDA_VISIBLE_DEVICES)")] = None
    map_by: Annotated[str, option(
        "--map-by", choices=values.MAP_POLICIES, forward=True,
        help="block: consecutive ranks share a GPU (default); round-robin: rank r on GPU r %% GPUs")] = "block"
    gpu_bind: Annotated[str, option(
        "--gpu-bind", choices=values.GPU_BINDS, forward=True,
        help="single: each rank sees one GPU (default); none: every rank sees all the job's GPUs, served by one MPS "
        "daemon (for codes that pick their own device)")] = "single"
    local_rank: Annotated[str, option(
        "--local-rank", choices=values.LOCAL_RANKS, forward=True,
        help="what LOCAL_RANK says: node: the rank's place among its node's ranks, as torchrun (default); device: a "
        "device number the rank can use (0 where each rank sees its one GPU), for scripts that use LOCAL_RANK as their "
        "device when ranks share a GPU")] = "node"
    thread_percentage: Annotated[values.ThreadSpec, option(
        "--thread-percentage", parse=_validated(values.parse_thread_spec), metavar="P|auto|P0,P1,...",
        render=_spec_text, forward=True,
        help="cap each rank's share of SMs: one value, auto (100 / ranks on that GPU) or one per rank")] = None
    mem_limit: Annotated[values.MemLimit, option(
        "--mem-limit", parse=_validated(values.parse_mem_limit), metavar="SIZE", render=values.mem_limit_text,
        forward=True,
        help="pinned device memory per rank, e.g. 4G or 512M (the ~0.5 GiB CUDA context counts), or auto: each GPU's "
        "free memory split among its ranks")] = None
    queues: Annotated[values.Queues, option(
        "--queues", parse=_validated(values.parse_queues), metavar="N|auto", render=str, forward=True,
        help="hardware work queues per MPS rank (CUDA_DEVICE_MAX_CONNECTIONS): N, or auto: 8 while the GPU's budget "
        "lasts (for programs that overlap more than 2 streams; each queue slows a client's start). Default: MPS's "
        "2")] = None
    priority: Annotated[int | None, option(
        "--priority", parse=_validated(values.parse_priority), metavar="0|1", forward=True,
        help="MPS client priority: 0 normal, 1 below normal")] = None
    mps: Annotated[str, option(
        "--mps", choices=values.MPS_MODES, forward=True,
        help="auto: MPS when a driver and nvidia-cuda-mps-control exist (default); on: fail without; off: "
        "never")] = "auto"
    launcher: Annotated[str, option(
        "--launcher", choices=values.LAUNCHERS,
        help="local: mpsrun starts the ranks; mpiexec: the real MPI launcher does; auto: mpiexec when it and mpi4py "
        "are installed")] = "auto"
    mpiexec: Annotated[str | None, option(
        "--mpiexec", parse=_validated(_executable), metavar="PATH",
        help="the mpiexec to use (default: mpiexec on PATH)")] = None
    mpiexec_args: Annotated[tuple[str, ...], option(
        "--mpiexec-arg", parse=str, metavar="ARG", append=True,
        help="pass ARG to mpiexec (repeatable; --mpiexec-arg=--bind-to=none for values starting with -)")] = ()
    module: Annotated[str | None, option(
        "-m", parse=_validated(values.parse_module), metavar="MODULE", env=False,
        help="run a Python module as the command (like python -m)")] = None
    exports: Annotated[tuple[str, ...], option(
        "-x", parse=_validated(values.parse_export), metavar="NAME[=VALUE]", append=True, env=False, forward=True,
        help="give every rank the variable NAME: the value it has here, or VALUE (repeatable; the rank's environment "
        "is the caller's already, but not on other hosts)")] = ()
    output_filename: Annotated[str | None, option(
        "--output-filename", parse=_validated(values.parse_output_dir), metavar="DIR", forward=True,
        help="each rank's stdout and stderr to DIR/rank.N/stdout and DIR/rank.N/stderr (not tagged); mpsrun's own "
        "lines stay on the terminal")] = None
    report: Annotated[str | None, option(
        "--report", parse=_validated(values.parse_report), metavar="FILE.json", forward=True,
        help="write each rank's account (peak device memory, wall and CPU time, exit code and cause) and the memory "
        "samples to FILE.json at the job's end; under a bare --per-node job each node writes FILE.HOST.json")] = None
    tag_output: Annotated[bool, option(
        "--tag-output", forward=True,
        help="prefix each output line with [rank N]")] = False
    timeout: Annotated[float | None, option(
        "--timeout", parse=_validated(_seconds(False)), metavar="SECONDS", forward=True,
        help="end the job after this long (exit 124)")] = None
    grace: Annotated[float, option(
        "--grace", parse=_validated(_seconds(True)), metavar="SECONDS", forward=True,
        help="wait this long after SIGTERM before SIGKILL when stopping ranks (default 5)")] = 5.0
    mpi4py_abort: Annotated[str, option(
        "--mpi4py-abort", choices=("on", "off"), forward=True,
        help="on (default): a Python rank runs under mpi4py's runner rules (python -m mpsrun.rank.pyrun) when mpi4py "
        "is installed, so an uncaught exception or sys.exit(N) aborts the MPI job instead of hanging in MPI_Finalize, "
        "and its traceback is what python FILE prints; off: run the command as given")] = "on"
    dry_run: Annotated[bool, option(
        "--dry-run",
        help="print the plan (each rank's GPU, limits and the variables mpsrun sets) and exit 0, starting nothing; "
        "works without a GPU (a batch script checked on a login node)")] = False
    keep_logs: Annotated[bool, option(
        "--keep-logs", forward=True,
        help="keep the session directory with the MPS logs")] = False
    hosts: Annotated[tuple[str, ...], option(
        "--hosts", parse=_validated(values.parse_hosts), metavar="A,B", render=_joined,
        help="run over these hosts through mpiexec, one MPS session per host")] = ()
    hostfile: Annotated[str | None, option(
        "--hostfile", parse=_validated(values.parse_hostfile), metavar="FILE",
        help="like --hosts, from the MPI launcher's host file")] = None
    per_node: Annotated[bool, option(
        "--per-node",
        help="this process is ONE rank started by srun or mpiexec: share the node's MPS session with the other local "
        "ranks")] = False
    tasks: Annotated[str | None, option(
        "--tasks", parse=_validated(values.parse_task_file), metavar="FILE",
        help="run a farm: each line of FILE (- for standard input) is one task's command, split as a shell splits "
        "it (never run through one); -np N slots, placed as ranks are, each running one task at a time")] = None
    array: Annotated[str | None, option(
        "--array", parse=_validated(values.parse_index_range_text), metavar="A-B[:STEP]",
        help="run a farm: the command once per index, {} in its arguments replaced by the index")] = None
    results: Annotated[str | None, option(
        "--results", parse=_validated(values.parse_report), metavar="FILE.jsonl",
        help="a farm's results: one JSON line per finished task, appended and flushed as it ends")] = None
    resume: Annotated[bool, option(
        "--resume",
        help="a farm runs only the tasks --results does not record as succeeded")] = False
    retries: Annotated[int, option(
        "--retries", parse=_validated(values.parse_retries), metavar="K",
        help="run a failed task up to K more times (default 0)")] = 0
    max_failures: Annotated[int | None, option(
        "--max-failures", parse=_validated(values.parse_count), metavar="M",
        help="a farm takes no new task after M tasks have failed")] = None
    verbose: Annotated[bool, option(
        "-v", "--verbose", forward=True,
        help="say what mpsrun does (placement, checks)")] = False
    quiet: Annotated[bool, option("-q", "--quiet", forward=True, help="only errors")] = False

    @property
    def ranks(self) -> int:
        return self.nranks or 1

    @property
    def farm(self) -> bool:
        """Whether this job is a farm of tasks (``--tasks``, ``--array``), not N ranks of one command."""
        return self.tasks is not None or self.array is not None

    def settings(self) -> dict[str, Any]:
        """The settings every rank of a per-node job must share (the forwarded options), as JSON."""
        return {name: value for name, value in self.to_json().items() if name in options() and options()[name].forward}

    def to_json(self) -> dict[str, Any]:
        """The configuration as JSON values (tuples as lists), for :meth:`from_json` in another process."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self._asdict().items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "JobConfig":
        """The configuration :meth:`to_json` wrote (validated where it was parsed, in the job's own process)."""
        unknown = sorted(set(data) - set(cls._fields))
        if unknown:
            raise ConfigError(f"not a job configuration: unknown setting(s) {', '.join(unknown)}", setting="config")
        settings: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                                    for name, value in data.items()}
        for name in ("thread_percentage", "mem_limit", "queues"):  # JSON wrote AUTO as its text
            if settings.get(name) == values.AUTO:
                settings[name] = values.AUTO
        return cls(**settings)


@functools.cache
def options() -> dict[str, Option]:
    """Field name -> declaration, in declaration order."""
    return {name: args[-1] for name, hint in JobConfig.__annotations__.items()
            if (args := get_args(hint)) and isinstance(args[-1], Option)}


def differing_options(settings: Mapping[str, Any], others: Mapping[str, Any]) -> list[str]:
    """The options (as spelled on the command line) two ranks' :meth:`JobConfig.settings` disagree on."""
    declared = options()
    return [declared[name].flags[-1] if name in declared else name
            for name in sorted(set(settings) | set(others)) if settings.get(name) != others.get(name)]


#: The options that make a job a farm, and the farm's own: its tasks get none of their variables (a task that runs
#: mpsrun runs a job of its own, not another farm into the same results).
FARM_OPTIONS = ("tasks", "array", "results", "resume", "retries", "max_failures")


def option_variables() -> set[str]:
    """The ``MPSRUN_<NAME>`` variables that set options."""
    return {spec.variable for spec in options().values() if spec.env}
