"""Every ``mpsrun`` option, declared once, and the job configuration they make.

Each field of :class:`JobConfig` carries its command-line declaration. From it come the
parser, the ``MPSRUN_<NAME>`` variable (named after the option's last spelling:
``--mem-limit`` -> ``MPSRUN_MEM_LIMIT``, ``-np`` -> ``MPSRUN_NP``), and what is passed on to
per-node ranks and node keepers (:func:`to_argv`). A value is validated once, where it is
parsed; the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from mpsrun.config.values import GPU_BINDS, MPS_MODES, ThreadSpec, parse_mem_limit, parse_priority, parse_thread_spec
from mpsrun.errors import ConfigError

__all__ = ["LAUNCHERS", "MAP_POLICIES", "JobConfig", "Option", "build_parser", "parse_args", "parse_options",
           "split_argv", "to_argv"]

LAUNCHERS = ("auto", "local", "mpiexec")
MAP_POLICIES = ("block", "round-robin")
MAX_RANKS = 1 << 20
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_METADATA = "mpsrun.option"


@dataclass(frozen=True, slots=True)
class Option:
    """How one setting is spelled and read. ``parse`` is None for an on/off switch."""

    flags: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    render: Callable[[Any], str] = str
    forward: bool = False  # passed on to per-node ranks and node keepers
    append: bool = False  # repeatable; the variable is split like a shell line
    env: bool = True

    @property
    def variable(self) -> str:
        return "MPSRUN_" + self.flags[-1].lstrip("-").upper().replace("-", "_")


def option(*flags: str, default: Any, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={_METADATA: Option(flags, help, **spec)})


def _problem(text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(text)


def _count(text: str) -> int:
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_RANKS:
        raise _problem(f"must be a whole number from 1 to {MAX_RANKS}, not {text!r}")
    return int(value)


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (0 <= value < 1e9 if allow_zero else 0 < value < 1e9):
            raise _problem(f"must be a {'' if allow_zero else 'positive '}number of seconds, not {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


def _validated(check: Callable[..., Any]) -> Callable[[str], Any]:
    """A shared validator as an argparse type (argparse names the option in its message)."""

    def parse(text: str) -> Any:
        try:
            return check(text, setting="value")
        except ConfigError as exc:
            raise _problem(str(exc)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def _gpus(text: str) -> tuple[int | str, ...] | None:
    if text.strip().lower() == "all":
        return None
    result: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        if part.isascii() and part.isdigit():
            result.append(int(part))
        elif part.startswith("GPU-") and len(part) > 4:
            result.append(part)
        else:
            raise _problem(f"must be all or a comma-separated list of GPU indices or GPU- UUIDs, not {text!r}")
    return tuple(result)


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise _problem(f"must name at least one host, not {text!r}")
    return hosts


def _hostfile(text: str) -> str:
    """A host file: a readable file naming at least one host (``host``, ``host:N`` or ``host slots=N`` lines)."""
    try:
        with open(text) as hostfile:
            lines = [line.split("#", 1)[0].strip() for line in hostfile]
    except (OSError, UnicodeDecodeError) as exc:
        raise _problem(f"cannot read host file {text!r}: {getattr(exc, 'strerror', None) or exc}") from None
    hosts = [line for line in lines if line]
    if not hosts:
        raise _problem(f"host file {text!r} names no host")
    for line in hosts:
        if not re.fullmatch(r"[A-Za-z0-9._-]+(:\d+)?(\s+(slots|max_slots|max-slots)=\d+)*", line):
            raise _problem(f"host file {text!r}: {line!r} is not a host line (host, host:N or host slots=N)")
    return text


def _executable(text: str) -> str:
    if shutil.which(text) is None:
        raise _problem(f"{text!r} is not an executable")
    return text


def _joined(value: Sequence[Any] | None) -> str:
    return "all" if value is None else ",".join(map(str, value))


def _spec_text(value: ThreadSpec) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfig:
    """Everything that defines one ``mpsrun`` job."""

    command: tuple[str, ...] = ()
    nranks: int | None = option("-n", "-np", default=None, parse=_count, metavar="N", forward=True,
                                help="number of ranks (default 1; under --per-node: as the launcher started them)")
    gpus: tuple[int | str, ...] | None = option(
        "--gpus", default=None, parse=_gpus, metavar="LIST", render=_joined, forward=True,
        help="GPUs to use: 0,1 or GPU- UUIDs, or all (default: all visible; honours CUDA_VISIBLE_DEVICES)")
    map_by: str = option("--map-by", default="block", choices=MAP_POLICIES, forward=True,
                         help="block: consecutive ranks share a GPU (default); round-robin: rank r on GPU r %% GPUs")
    gpu_bind: str = option("--gpu-bind", default="single", choices=GPU_BINDS, forward=True,
                           help="single: each rank sees one GPU (default); none: every rank sees all the job's GPUs, "
                           "served by one MPS daemon (for codes that pick their own device)")
    thread_percentage: ThreadSpec = option(
        "--thread-percentage", default=None, parse=_validated(parse_thread_spec), metavar="P|auto|P0,P1,...",
        render=_spec_text, forward=True,
        help="cap each rank's share of SMs: one value, auto (100 / ranks on that GPU) or one per rank")
    mem_limit: str | None = option("--mem-limit", default=None, parse=_validated(parse_mem_limit), metavar="SIZE",
                                   forward=True, help="pinned device memory per rank, e.g. 4G or 512M (the ~0.5 GiB "
                                   "CUDA context counts), or auto: each GPU's free memory split among its ranks")
    priority: int | None = option("--priority", default=None, parse=_validated(parse_priority), metavar="0|1",
                                  forward=True, help="MPS client priority: 0 normal, 1 below normal")
    mps: str = option("--mps", default="auto", choices=MPS_MODES, forward=True,
                      help="auto: MPS when a driver and nvidia-cuda-mps-control exist (default); on: fail without; "
                      "off: never")
    launcher: str = option("--launcher", default="auto", choices=LAUNCHERS,
                           help="local: mpsrun starts the ranks; mpiexec: the real MPI launcher does; "
                           "auto: mpiexec when it and mpi4py are installed")
    mpiexec: str | None = option("--mpiexec", default=None, parse=_executable, metavar="PATH",
                                 help="the mpiexec to use (default: mpiexec on PATH)")
    mpiexec_args: tuple[str, ...] = option(
        "--mpiexec-arg", default=(), parse=str, metavar="ARG", append=True,
        help="pass ARG to mpiexec (repeatable; --mpiexec-arg=--bind-to=none for values starting with -)")
    module: str | None = option("-m", default=None, parse=str, metavar="MODULE", env=False,
                                help="run a Python module as the command (like python -m)")
    tag_output: bool = option("--tag-output", default=False, forward=True, help="prefix each output line with [rank N]")
    timeout: float | None = option("--timeout", default=None, parse=_seconds(False), metavar="SECONDS", forward=True,
                                   help="end the job after this long (exit 124)")
    grace: float = option("--grace", default=5.0, parse=_seconds(True), metavar="SECONDS", forward=True,
                          help="wait this long after SIGTERM before SIGKILL when stopping ranks (default 5)")
    mpi4py_abort: str = option(
        "--mpi4py-abort", default="on", choices=("on", "off"), forward=True,
        help="on (default): a Python rank runs through mpi4py's runner (python -m mpi4py) when mpi4py is installed, "
        "so an uncaught exception or sys.exit(N) aborts the MPI job instead of hanging in MPI_Finalize; "
        "off: run the command as given")
    keep_logs: bool = option("--keep-logs", default=False, forward=True,
                             help="keep the session directory with the MPS logs")
    hosts: tuple[str, ...] = option("--hosts", default=(), parse=_hosts, metavar="A,B", render=_joined,
                                    help="run over these hosts through mpiexec, one MPS session per host")
    hostfile: str | None = option("--hostfile", default=None, parse=_hostfile, metavar="FILE",
                                  help="like --hosts, from the MPI launcher's host file")
    per_node: bool = option("--per-node", default=False,
                            help="this process is ONE rank started by srun or mpiexec: share the node's MPS session "
                            "with the other local ranks")
    verbose: bool = option("-v", "--verbose", default=False, forward=True,
                           help="say what mpsrun does (placement, checks)")
    quiet: bool = option("-q", "--quiet", default=False, forward=True, help="only errors")

    @property
    def ranks(self) -> int:
        return self.nranks or 1


def options() -> dict[str, Option]:
    """Field name -> declaration, in declaration order."""
    return {f.name: f.metadata[_METADATA] for f in fields(JobConfig) if _METADATA in f.metadata}


def option_variables() -> set[str]:
    """The ``MPSRUN_<NAME>`` variables that set options."""
    return {spec.variable for spec in options().values() if spec.env}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message, setting="command line")


def build_parser(description: str = "", epilog: str = "", version: str = "") -> argparse.ArgumentParser:
    parser = _Parser(prog="mpsrun", usage="mpsrun [options] [--] command [args...]\n"
                     "       mpsrun [options] -m module [args...]", description=description, epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    for name, spec in options().items():
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": spec.help}
        if spec.parse is None and spec.choices is None:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=spec.parse, metavar=spec.metavar, choices=spec.choices)
            kwargs["action"] = "append" if spec.append else "store"
        parser.add_argument(*spec.flags, **kwargs)
    parser.add_argument("--version", action="version", version=f"mpsrun {version}")
    return parser


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Split ``argv`` into mpsrun's options and the command, the way mpirun does.

    Options end at the first word that is not an option (or its value), at ``--``, or
    after ``-m MODULE`` (the words after it are the module's arguments).
    """
    takes_value = {flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings}
    options_: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return options_, list(argv[index + 1 :])
        if not word.startswith("-") or word == "-":
            return options_, list(argv[index:])
        name = word.split("=", 1)[0]
        if name in takes_value and "=" not in word and index + 1 < len(argv):
            value = argv[index + 1]
            # --opt=value lets a value start with "-" (argparse would take it for an option).
            options_.extend([f"{word}={value}"] if word.startswith("--") else [word, value])
            index += 1
            if name == "-m":
                return options_, list(argv[index + 1 :])
        else:
            options_.append(word)
        index += 1
    return options_, []


def _from_variable(name: str, spec: Option, text: str) -> Any:
    if spec.parse is None and spec.choices is None:
        if text.strip().lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{spec.variable} must be 1 or 0 (true/false), not {text!r}", setting=spec.variable)
        return text.strip().lower() in _TRUE
    try:
        if spec.append:
            return tuple(shlex.split(text))
        value = spec.parse(text) if spec.parse else text.strip()
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ConfigError(f"{spec.variable}: {exc}", setting=spec.variable, value=text) from None
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{spec.variable} must be one of {', '.join(spec.choices)}, not {text!r}",
                          setting=spec.variable, value=text)
    return value


#: Options that exclude each other: one given on the command line silences the others' variables.
EXCLUSIVE = (("verbose", "quiet"), ("hosts", "hostfile"))


def _overridden(name: str, given: Mapping[str, Any]) -> bool:
    """Whether the command line sets an option that excludes ``name`` (the command line wins)."""
    return any(name in group and any(other in given for other in group if other != name) for group in EXCLUSIVE)


def parse_options(words: Sequence[str], environ: Mapping[str, str], version: str = "") -> dict[str, Any]:
    """The option values from option words, then ``MPSRUN_*`` variables for options they do not give."""
    parser = build_parser(version=version)
    given = vars(parser.parse_args(list(words)))
    values: dict[str, Any] = {}
    for name, spec in options().items():
        if name in given:
            values[name] = tuple(given[name]) if spec.append else given[name]
        elif spec.env and spec.variable in environ and not _overridden(name, given):
            values[name] = _from_variable(name, spec, environ[spec.variable])
    if values.get("verbose") and values.get("quiet"):
        raise ConfigError("-v/--verbose and -q/--quiet cannot be used together", setting="--quiet")
    if values.get("hosts") and values.get("hostfile"):
        raise ConfigError("give --hosts or --hostfile, not both", setting="--hosts")
    return values


def parse_args(argv: Sequence[str], environ: Mapping[str, str], version: str = "") -> JobConfig:
    """Turn a command line (and ``MPSRUN_*`` variables for options it does not give) into a JobConfig.

    Raises :class:`ConfigError` for anything invalid; argparse's SystemExit for --help/--version.
    """
    words, command = split_argv(argv, build_parser(version=version))
    values = parse_options(words, environ, version)
    if values.get("module") is not None:
        command = [sys.executable, "-m", values["module"], *command]
    if not command:
        raise ConfigError("no command given: mpsrun [options] [--] command [args...]", setting="command")
    return JobConfig(command=tuple(command), **values)


def to_argv(config: JobConfig, forwarded_only: bool = True) -> list[str]:
    """The options that reproduce ``config`` (those passed on to per-node ranks, by default)."""
    argv: list[str] = []
    defaults = JobConfig()
    for name, spec in options().items():
        value = getattr(config, name)
        if (forwarded_only and not spec.forward) or value == getattr(defaults, name):
            continue
        flag = spec.flags[-1]
        if spec.parse is None and spec.choices is None:
            argv.append(flag)
        elif spec.append:
            argv += [f"{flag}={item}" for item in value]
        else:
            argv.append(f"{flag}={spec.render(value)}")
    return argv
