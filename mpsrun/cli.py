"""The ``mpsrun`` command line: mpirun-style options, then the command to run as every rank.

Options end at the first word that is not an option (or its value), at ``--``, or at
``-m MODULE``. Every option can also come from an ``MPSRUN_<NAME>`` environment
variable (``--mem-limit`` from ``MPSRUN_MEM_LIMIT``); the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from mpsrun import __version__
from mpsrun.errors import CommandNotFoundError, ConfigError, MPSError
from mpsrun.launch import (
    EXIT_NOT_FOUND,
    EXIT_SETUP,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LAUNCHERS,
    JobConfig,
    run_job,
)
from mpsrun.limits import MPS_MODES, parse_mem_limit, parse_priority
from mpsrun.placement import MAP_POLICIES, parse_thread_spec

__all__ = ["main", "parse_args"]

T = TypeVar("T")

DESCRIPTION = """\
Run COMMAND as N ranks that share the GPUs through a private NVIDIA MPS daemon per GPU.
mpsrun starts the daemons for this job only, gives each rank its GPU and MPS limits,
checks that every rank really is an MPS client, and removes everything when the job ends.
"""

EPILOG = f"""\
examples:
  mpsrun -np 4 python sim.py               4 ranks sharing every visible GPU through MPS
  mpsrun -np 8 --gpus 0,1 python sim.py    ranks 0-3 on GPU 0, ranks 4-7 on GPU 1 (--map-by block)
  mpsrun -np 4 --thread-percentage auto -m mypkg.train --epochs 3
                                           each rank capped at 25%% of the SMs; run a module
  mpsrun -np 2 --mem-limit 8G --tag-output -- ./solver -i input.dat
                                           8 GiB pinned memory per rank; output lines tagged [rank N]
  mpsrun -np 4 --mps off python sim.py     the same job without MPS (the time-sliced baseline)
  mpsrun -np 4 --launcher mpiexec --mpiexec-arg=--bind-to=none python sim.py
                                           run the ranks through the real mpiexec (mpi4py sees size 4)
  srun -n 8 mpsrun --per-node python sim.py
                                           under srun or mpiexec: one MPS session per node for its local ranks

subcommands:
  mpsrun bench [--ranks 1,2,4,8,16] [--json] [--plot FILE.png]
                                           measure time-sliced vs MPS vs one process on this GPU
  mpsrun doctor [--json]                   can MPS work here, and if not, why not (exit 0 if it can)
  mpsrun status [--json]                   this user's sessions on this node (owner, daemons, age)
  mpsrun cleanup [--force SESSION]         stop and remove stale sessions (owner gone); never others'
  (a program called "bench", "doctor", "status" or "cleanup" runs as: mpsrun -- bench)

exit status:
  0     every rank succeeded
  N     otherwise the exit code of the rank that failed first (killed by signal S: 128+S)
  {EXIT_USAGE}     usage error (bad option or value, no command)
  {EXIT_SETUP}     set-up failure: MPS required but unavailable, the daemon would not start,
        or (with --mps on) a rank ran without MPS
  {EXIT_TIMEOUT}   --timeout expired
  130   interrupted (SIGINT); 143 terminated (SIGTERM); 129 hang-up (SIGHUP)
  {EXIT_NOT_FOUND}   the command was not found

environment:
  Every option has a variable: MPSRUN_NP, MPSRUN_GPUS, MPSRUN_MAP_BY, MPSRUN_THREAD_PERCENTAGE,
  MPSRUN_MEM_LIMIT, MPSRUN_PRIORITY, MPSRUN_MPS, MPSRUN_LAUNCHER, MPSRUN_MPIEXEC,
  MPSRUN_MPIEXEC_ARG (split like a shell line), MPSRUN_TAG_OUTPUT, MPSRUN_TIMEOUT, MPSRUN_GRACE,
  MPSRUN_KEEP_LOGS, MPSRUN_VERBOSE, MPSRUN_QUIET (1/true/yes to switch on).
  MPSRUN_TMPDIR: where session directories go (default $XDG_RUNTIME_DIR, else /tmp).
  Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES (its GPU's
  UUID), CUDA_MPS_PIPE_DIRECTORY and, when set, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_CLIENT_PRIORITY.
"""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message, setting="command line")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


def _grace(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return _seconds(text)


def _checked(parse: Callable[..., T]) -> Callable[[str], T]:
    """Turn a ConfigError from a shared validator into argparse's error type."""

    def convert(text: str) -> T:
        try:
            return parse(text, setting="value")  # argparse already names the option
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _gpus(text: str) -> tuple[int | str, ...] | None:
    text = text.strip()
    if text.lower() == "all":
        return None
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"must be all or a comma-separated list of GPU indices or UUIDs, not {text!r}")
    result: list[int | str] = []
    for part in parts:
        if part.isdigit():
            result.append(int(part))
        elif part.startswith("GPU-"):
            result.append(part)
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is not a GPU index or GPU- UUID")
    return tuple(result)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mpsrun",
        usage="mpsrun [options] [--] command [args...]\n       mpsrun [options] -m module [args...]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("-n", "-np", dest="np", type=_positive_int, default=1, metavar="N", help="number of ranks (default 1)")
    add(
        "--gpus",
        type=_gpus,
        default=None,
        metavar="LIST",
        help="GPUs to use: 0,1 or GPU- UUIDs, or all (default: all visible; honours CUDA_VISIBLE_DEVICES)",
    )
    add(
        "--map-by",
        choices=MAP_POLICIES,
        default="block",
        help="block: consecutive ranks share a GPU (default); round-robin: rank r on GPU r %% number of GPUs",
    )
    add(
        "--thread-percentage",
        type=_checked(parse_thread_spec),
        default=None,
        metavar="P|auto|P0,P1,...",
        help="cap each rank's share of SMs: one value, auto (100 / ranks on that GPU) or one per rank",
    )
    add(
        "--mem-limit",
        type=_checked(parse_mem_limit),
        default=None,
        metavar="SIZE",
        help="pinned device memory per rank, e.g. 4G or 512M (includes the ~0.5 GiB CUDA context)",
    )
    add(
        "--priority",
        type=_checked(parse_priority),
        default=None,
        metavar="0|1",
        help="MPS client priority: 0 normal, 1 below normal",
    )
    add(
        "--mps",
        choices=MPS_MODES,
        default="auto",
        help="auto: MPS when a driver and nvidia-cuda-mps-control exist (default); on: fail without; off: never",
    )
    add(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="local: mpsrun starts the ranks; mpiexec: the real MPI launcher does; "
        "auto: mpiexec when it and mpi4py are installed",
    )
    add("--mpiexec", default=None, metavar="PATH", help="the mpiexec to use (default: mpiexec on PATH)")
    add(
        "--mpiexec-arg",
        dest="mpiexec_args",
        action="append",
        default=None,
        metavar="ARG",
        help="pass ARG to mpiexec (repeatable; --mpiexec-arg=--bind-to=none for values starting with -)",
    )
    add("-m", dest="module", default=None, metavar="MODULE", help="run a Python module as the command (like python -m)")
    add("--tag-output", action="store_true", default=False, help="prefix each output line with [rank N]")
    add("--timeout", type=_seconds, default=None, metavar="SECONDS", help="end the job after this long (exit 124)")
    add(
        "--grace",
        type=_grace,
        default=5.0,
        metavar="SECONDS",
        help="wait this long after SIGTERM before SIGKILL when stopping ranks (default 5)",
    )
    add("--keep-logs", action="store_true", default=False, help="keep the session directory with the MPS logs")
    add(
        "--hosts",
        default=None,
        metavar="A,B",
        help="run over these hosts through mpiexec, one MPS session per host (each rank via --per-node)",
    )
    add("--hostfile", default=None, metavar="FILE", help="like --hosts, from the MPI launcher's host file")
    add(
        "--per-node",
        action="store_true",
        default=False,
        help="this process is ONE rank started by srun or mpiexec: share the node's MPS daemons with the other "
        "local ranks (the first starts them, the last stops them)",
    )
    add("-v", "--verbose", action="store_true", default=False, help="say what mpsrun does (placement, checks)")
    add("-q", "--quiet", action="store_true", default=False, help="only errors")
    add("--version", action="version", version=f"mpsrun {__version__}")
    return parser


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Split ``argv`` into mpsrun's options and the command, the way mpirun does.

    ``-m MODULE`` stays in the options; the words after it are the module's arguments.
    """
    takes_value = {option for action in parser._actions if action.nargs != 0 for option in action.option_strings}
    options: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return options, list(argv[index + 1 :])
        if not word.startswith("-") or word == "-":
            return options, list(argv[index:])
        name = word.split("=", 1)[0]
        if name in takes_value and "=" not in word and index + 1 < len(argv):
            value = argv[index + 1]
            # --opt=value lets a value start with "-" (argparse would take it for an option).
            options.extend([f"{word}={value}"] if word.startswith("--") else [word, value])
            index += 1
            if name == "-m":
                return options, list(argv[index + 1 :])
        else:
            options.append(word)
        index += 1
    return options, []


def _env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Apply ``MPSRUN_<NAME>`` variables as defaults (argparse converts string defaults)."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version", "module"):
            continue
        name = "MPSRUN_" + action.dest.upper() if action.dest != "mpiexec_args" else "MPSRUN_MPIEXEC_ARG"
        value = environ.get(name)
        if value is None:
            continue
        if action.nargs == 0:
            lowered = value.strip().lower()
            if lowered not in _TRUE + _FALSE:
                raise ConfigError(f"{name} must be 1 or 0 (true/false), not {value!r}", setting=name, value=value)
            action.default = lowered in _TRUE
        elif action.dest == "mpiexec_args":
            action.default = shlex.split(value)
        else:
            try:
                action.default = action.type(value) if action.type else value  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ConfigError(f"{name}: {exc}", setting=name, value=value) from None
            if action.choices is not None and action.default not in action.choices:
                raise ConfigError(
                    f"{name} must be one of {', '.join(map(str, action.choices))}, not {value!r}",
                    setting=name,
                    value=value,
                )


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> tuple[JobConfig, int]:
    """Turn a command line into a :class:`JobConfig` and a log level. Raises ConfigError."""
    parser = build_parser()
    _env_defaults(parser, os.environ if environ is None else environ)
    options, command = split_argv(argv, parser)
    args = parser.parse_args(options)
    if args.module is not None:
        command = [sys.executable, "-m", args.module, *command]
    if not command:
        raise ConfigError("no command given: mpsrun [options] [--] command [args...]", setting="command")
    if args.verbose and args.quiet:
        raise ConfigError("-v/--verbose and -q/--quiet cannot be used together", setting="--quiet")
    config = JobConfig(
        command=tuple(command),
        nranks=args.np,
        gpus=args.gpus,
        map_by=args.map_by,
        thread_percentage=args.thread_percentage,
        mem_limit=args.mem_limit,
        priority=args.priority,
        mps=args.mps,
        launcher=args.launcher,
        mpiexec=args.mpiexec,
        mpiexec_args=tuple(args.mpiexec_args or ()),
        tag_output=args.tag_output,
        timeout=args.timeout,
        grace=args.grace,
        keep_logs=args.keep_logs,
        verbose=args.verbose,
        per_node=args.per_node,
        hosts=tuple(h.strip() for h in args.hosts.split(",") if h.strip()) if args.hosts else (),
        hostfile=args.hostfile,
    )
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    return config, level


def _print_error(message: str) -> None:
    print(f"mpsrun: error: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpsrun`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"]:  # a program named "bench" runs as: mpsrun -- bench
        from mpsrun import bench

        return bench.main(args[1:])
    if args[:1] == ["doctor"]:
        from mpsrun import doctor

        return doctor.main(args[1:])
    if args[:1] in (["status"], ["cleanup"]):
        from mpsrun import registry

        return registry.main(args[1:], args[0])
    if args[:1] in (["-h"], ["--help"]) or not args:
        build_parser().print_help(sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USAGE
    try:
        config, level = parse_args(args)
    except ConfigError as exc:
        _print_error(f"{exc} (see mpsrun --help)")
        return EXIT_USAGE
    except SystemExit as exc:  # --help/--version further along the line
        return int(exc.code or 0)
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    logging.getLogger("mpsrun").setLevel(level)
    try:
        if config.per_node:
            from mpsrun.pernode import run_per_node

            result = run_per_node(config)
        else:
            result = run_job(config)
    except CommandNotFoundError as exc:
        _print_error(str(exc))
        return EXIT_NOT_FOUND
    except MPSError as exc:
        _print_error(str(exc))
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_SETUP
    return result.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
