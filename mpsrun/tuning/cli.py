"""``mpsrun tune``: the command line over :func:`mpsrun.tuning.tune`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from mpsrun.errors import ConfigError, MPSError
from mpsrun.exitcodes import ExitCode, Outcome, exit_code
from mpsrun.runtime.output import say
from mpsrun.tuning import tune
from mpsrun.tuning.report import check_plot_path, format_report, plot

__all__ = ["main"]

USAGE = ("mpsrun tune [--ranks 1,2,4,8] [--thread-percentage none,auto,50] [--mps on,off] [--queues default,auto,8]\n"
         "                   [--repeats N] [--budget SECONDS] [--scaling weak|strong] [--metric REGEX]\n"
         "                   [--json] [--plot FILE.png] [job options...] -- command [args...]")
DESCRIPTION = """Measure your own command as real mpsrun jobs under candidate settings, and say which to run.

Each setting (every combination of the lists) runs as `mpsrun -np N --mps M [--thread-percentage T]
[--queues Q] [job options] -- command`, after one warm-up run, --repeats times, in alternating order
(--queues: each MPS rank's hardware work queues; default: not set, MPS's 2). Throughput is
ranks / seconds (--scaling weak: each rank does the command's whole work), 1 / seconds (--scaling
strong: the job's work is fixed), or with --metric the sum over ranks of the number each rank prints
last that REGEX matches (its first group). Settings whose min-max spreads overlap are a tie. The
baseline is one rank (--mps off if listed); the best is recommended only when its whole spread lies
above the baseline's."""
EPILOG = """job options: any mpsrun option but -np, --mps, --thread-percentage and --queues (--gpus, --mem-limit,
--launcher, ...), applied to every trial.
exit status: 0 measured; 2 bad settings (nothing runs); 3 every trial failed; 128+S stopped by signal S
(what was measured until then is still shown)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message, setting="command line")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpsrun tune", usage=USAGE, description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", help="rank counts (1, then 1, 2, 4 and 8 per GPU)")
    parser.add_argument("--thread-percentage", help="active-thread percentages, none for unset (none)")
    parser.add_argument("--mps", help="MPS modes (on,off)")
    parser.add_argument("--queues", help="hardware queues per MPS rank, as mpsrun's --queues takes them, default "
                        "for not set (default)")
    parser.add_argument("--repeats", default="3", help="counted runs of each setting (3)")
    parser.add_argument("--budget", help="seconds for the whole tuning; settings it cannot reach are left out")
    parser.add_argument("--scaling", default="weak", help="weak (each rank does the work) or strong (weak)")
    parser.add_argument("--metric", metavar="REGEX", help="a number each rank prints: throughput is their sum")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the throughputs (needs matplotlib)")
    return parser


def _split(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """Tune's options, the job options and the command."""
    words = list(argv)
    if "--" not in words and any(word == "--tasks" or word.startswith("--tasks=") for word in words):
        args, job_options = _parser().parse_known_args(words)  # a farm of a task file: no command
        return args, job_options, []
    if "--" not in words:
        if any(word in ("-h", "--help") for word in words):
            _parser().parse_args(["--help"])
        raise ConfigError("put the command after --: " + USAGE.split("\n")[0].split(" [")[0] +
                          " [options] -- command [args...]", setting="command")
    split = words.index("--")
    args, job_options = _parser().parse_known_args(words[:split])
    return args, job_options, words[split + 1:]


def main(argv: Sequence[str]) -> int:
    try:
        args, job_options, command = _split(argv)
        if args.plot is not None:
            check_plot_path(args.plot)
        lists = {name: value for name in ("ranks", "thread_percentage", "mps", "queues")
                 if (value := getattr(args, name)) is not None}
        result = tune(command, options=job_options, scaling=args.scaling, metric=args.metric, repeats=args.repeats,
                      budget=args.budget, progress=say, **lists)
    except MPSError as exc:  # a bad setting (exit 2), or a command the warm-up could not run (126, 127)
        say(f"mpsrun tune: error: {exc}")
        return exc.exit_code
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(format_report(result, int(args.repeats)))
    if args.plot and result.best is not None:
        try:
            plot(result, args.plot)
        except MPSError as exc:
            say(f"mpsrun tune: error: {exc}")
            return ExitCode.SETUP
    if result.interrupted is not None:
        return exit_code(Outcome("signal", result.interrupted))
    return ExitCode.OK if result.best is not None else ExitCode.SETUP
