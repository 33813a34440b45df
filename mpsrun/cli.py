"""The ``mpsrun`` command line: mpirun-style options, then the command to run as every rank.

Options end at the first word that is not an option (or its value), at ``--``, or at
``-m MODULE``. Every option can also come from an ``MPSRUN_<NAME>`` environment variable
(:mod:`mpsrun.config.options` declares each once); the command line wins.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from collections.abc import Sequence

from mpsrun import __version__
from mpsrun.config.commandline import build_parser, parse_args
from mpsrun.config.options import JobConfig, options
from mpsrun.errors import ConfigError, InterruptionError, MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.constants import CONFIG_VARIABLE, CONTROL_VARIABLE
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.output import escaped, say

__all__ = ["main"]

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
                                           each rank capped at 25% of the SMs; run a module
  mpsrun -np 2 --mem-limit 8G --tag-output -- ./solver -i input.dat
                                           8 GiB pinned memory per rank; output lines tagged [rank N]
  mpsrun -np 4 --mps off python sim.py     the same job without MPS (the time-sliced baseline)
  mpsrun -np 4 --launcher mpiexec --mpiexec-arg=--bind-to=none python sim.py
                                           run the ranks through the real mpiexec (mpi4py sees size 4)
  srun -n 8 mpsrun --per-node python sim.py
                                           under srun or mpiexec: one MPS session per node for its local ranks

subcommands:
  mpsrun bench [--ranks 1,2,4,8,16] [--repeats 3] [--json] [--plot FILE.png]
                                           measure time-sliced vs MPS vs one process on this GPU
  mpsrun tune [--ranks 1,2,4,8] [--mps on,off] [--thread-percentage none,auto] [...] -- command
                                           run your command under candidate settings; say which to use
  mpsrun doctor [--json]                   can MPS work here, and if not, why not (exit 0 if it can)
  mpsrun status [--json]                   this user's sessions on this node (owner, daemons, age)
  mpsrun top [JOB] [--once | --json]       this user's running ranks on this node: device memory, limits, CPU
  mpsrun cleanup [--force SESSION]         stop and remove stale sessions (owner gone); never others'
  (a program called "bench", "tune", "doctor", "status", "top" or "cleanup" runs as: mpsrun -- bench)

exit status (the same under every launcher):
  0     every rank succeeded
  N     otherwise the exit code of the rank that failed first (killed by signal S: 128+S)
  {ExitCode.USAGE:<5} usage error (bad option or value, no command)
  {ExitCode.SETUP:<5} set-up failure: MPS required but unavailable, the daemon would not start,
        or (with --mps on) a rank ran without MPS
  {ExitCode.TIMEOUT:<5} --timeout expired
  {ExitCode.NOT_EXECUTABLE:<5} the command could not be executed
  {ExitCode.NOT_FOUND:<5} the command was not found
  130   interrupted (SIGINT); 143 terminated (SIGTERM); 129 hang-up (SIGHUP)

environment:
{textwrap.fill("Every option has a variable: " + ", ".join(spec.variable for spec in options().values() if spec.env),
                width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)}
  (switches take 1/true/yes or 0/false/no; MPSRUN_MPIEXEC_ARG is split like a shell line).
  MPSRUN_TMPDIR: where session directories go (default $XDG_RUNTIME_DIR, else /tmp).
  Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES (its GPU's
  UUID), CUDA_MPS_PIPE_DIRECTORY and, when set, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_CLIENT_PRIORITY; and MASTER_ADDR, MASTER_PORT for
  torch.distributed's env:// (unless set here).
"""


def _print_error(message: str) -> None:
    say(f"mpsrun: error: {message}")


def _subcommand(args: list[str]) -> int | None:
    """Run ``bench``, ``tune``, ``doctor``, ``status``, ``top`` or ``cleanup``; None when the words are a job."""
    if args[:1] == ["bench"]:  # a program named "bench" runs as: mpsrun -- bench
        from mpsrun.tools import bench

        return bench.main(args[1:])
    if args[:1] == ["tune"]:
        from mpsrun.tuning import cli as tune_cli

        return tune_cli.main(args[1:])
    if args[:1] == ["doctor"]:
        from mpsrun.tools import doctor

        return doctor.main(args[1:])
    if args[:1] == ["top"]:
        from mpsrun.tools import top

        return top.main(args[1:])
    if args[:1] in (["status"], ["cleanup"]):
        from mpsrun.session import registry

        return registry.main(args[1:], args[0])
    return None


def main(argv: Sequence[str] | None = None, pending: Sequence[int] = ()) -> int:
    """Entry point of the ``mpsrun`` command; returns the exit status.

    A stopping signal that comes before a job's own handling takes over (``pending``: noted by
    :mod:`mpsrun._entry` during the imports; later, while options are read and modules
    imported) gives one line and 128+N, never a traceback.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with Interrupts():
            if pending:
                raise InterruptionError(signal=pending[0])
            return _main(args)
    except InterruptionError as exc:
        if _per_node(args):  # every rank got the signal: said once, as a rank stopped before its start says it
            from mpsrun.rank.join import report_interrupt

            report_interrupt(exc, _local_rank())
        else:
            _print_error(f"{exc} before the job started")
        return exc.exit_code


def _per_node(args: list[str]) -> bool:
    """Whether this command line is a --per-node rank's (every rank of the job reads the same one)."""
    return "--per-node" in (args[: args.index("--")] if "--" in args else args)


def _local_rank() -> int | None:
    from mpsrun.rank.identity import identity_from_env

    identity = identity_from_env(os.environ)
    return identity.local_rank if identity is not None else None


def _usage_error(args: list[str], exc: ConfigError) -> None:
    """Say what is wrong with the command line; under --per-node, where every rank reads the same one, through
    the route every rank that cannot start takes (said once: by the node's first rank, or the job's controller)."""
    if not _per_node(args):
        _print_error(f"{exc} (see mpsrun --help)")
        return
    from mpsrun.rank.join import report_failure

    report_failure(exc, _local_rank())


def _main(args: list[str]) -> int:
    subcommand = _subcommand(args)
    if subcommand is not None:
        return subcommand
    farm = any(options()[name].variable in os.environ for name in ("tasks", "array"))  # (its errors are said)
    if args[:1] in (["-h"], ["--help"]) or (not args and not farm):
        parser: argparse.ArgumentParser = build_parser(DESCRIPTION, EPILOG, __version__)
        parser.print_help(sys.stdout if args else sys.stderr)
        return ExitCode.OK if args else ExitCode.USAGE
    try:
        config = _config(args)
    except ConfigError as exc:
        _usage_error(args, exc)
        return ExitCode.USAGE
    except SystemExit as exc:  # --help/--version further along the line
        return int(exc.code or 0)
    _log_to_stderr(logging.DEBUG if config.verbose else logging.ERROR if config.quiet else logging.WARNING)
    if not config.per_node:  # under --per-node every rank reads the command line: not said by each
        _warn_unset_exports(config)
    try:
        if config.farm:
            from mpsrun.farm.run import run_farm, show

            return show(config) if config.dry_run else run_farm(config)
        if config.dry_run:
            from mpsrun.job.dryrun import show

            return show(config)
        if config.per_node:
            from mpsrun.agent.pernode import run_per_node

            return run_per_node(config)
        from mpsrun.job.run import run_job

        return run_job(config).exit_code
    except MPSError as exc:
        if config.per_node and isinstance(exc, InterruptionError):  # every rank got the signal, this one before its
            raise  # own handling took it: main() says it once per node, not an 'error:' line from each such rank
        _print_error(str(exc))
        return exc.exit_code
    except OSError as exc:  # what the machine refused that no step said better: one line, exit 3, never a traceback
        _print_error(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return ExitCode.SETUP


def _config(args: list[str]) -> JobConfig:
    """The job's configuration from the command line; a host's ``mpsrun --per-node`` under ``mpsrun --hosts`` is
    handed the job's, as data (:class:`~mpsrun.job.backends.HostsBackend`), and reads no option again."""
    handed = os.environ.get(CONFIG_VARIABLE)
    if handed and os.environ.get(CONTROL_VARIABLE) and args[:2] == ["--per-node", "--"] and len(args) > 2:
        return JobConfig.from_json(json.loads(handed))._replace(command=tuple(args[2:]), per_node=True)
    return parse_args(args, os.environ, __version__)


def _warn_unset_exports(config: JobConfig) -> None:
    """``-x NAME`` of a NAME not set here gives the ranks none, as asked; likely a typing error, so it is said."""
    for name in (item for item in config.exports if "=" not in item):
        logging.getLogger("mpsrun").warning(f"mpsrun: warning: -x {name}: {name} is not set here, so the ranks have "
                                            "none")


class _Lines(logging.Formatter):
    """Each record one line, escaped as :func:`~mpsrun.runtime.output.say` writes (host and GPU names, a rank's
    words)."""

    def format(self, record: logging.LogRecord) -> str:
        return escaped(super().format(record))


def _log_to_stderr(level: int) -> None:
    """The command's own warnings (and with -v its progress) as plain lines on stderr, one write each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lines("%(message)s"))
    logger = logging.getLogger("mpsrun")
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
