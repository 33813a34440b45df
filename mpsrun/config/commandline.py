"""The ``mpsrun`` command line and ``MPSRUN_*`` variables, read into a :class:`~mpsrun.config.options.JobConfig`.

Options end at the first word that is not an option (or its value), at ``--``, or after
``-m MODULE``, as with ``mpirun``. Every option can also come from its ``MPSRUN_<NAME>`` variable;
the command line wins.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from mpsrun.config import values
from mpsrun.config.options import FARM_OPTIONS, JobConfig, Option, options
from mpsrun.errors import ConfigError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.output import escaped

__all__ = ["EXCLUSIVE", "OneLineParser", "build_parser", "parse_args", "parse_options", "split_argv"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
#: Options that exclude each other: one given on the command line silences the others' variables.
EXCLUSIVE = (("verbose", "quiet"), ("hosts", "hostfile"), ("tasks", "array"))
_GLUED_NP = re.compile(r"-np[0-9]+")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message + _suggestion(message, self._option_string_actions), setting="command line")


#: Other launchers' options, and what mpsrun takes instead (a close spelling of an unrelated option would mislead).
_FOREIGN = {
    "--nproc-per-node": "torchrun's --nproc-per-node is mpsrun's -np N, the ranks on this node",
    "--nproc_per_node": "torchrun's --nproc_per_node is mpsrun's -np N, the ranks on this node",
    "--nnodes": "for several nodes, use --hosts A,B, or start mpsrun --per-node under srun or mpiexec",
    "--standalone": "mpsrun needs no rendezvous options: every rank gets MASTER_ADDR and MASTER_PORT",
    "--npernode": "mpsrun places the ranks on this node's GPUs: -np N",
    "-ppn": "mpsrun places the ranks on this node's GPUs: -np N",
    "-N": "Slurm's -N, nodes, is --hosts A,B, or srun -N M mpsrun --per-node; Open MPI's -N, ranks on this node, "
          "is -np N",
    "-c": "Open MPI's -c is mpsrun's -np N; Slurm's -c, CPUs per rank, is srun's: srun -c C mpsrun --per-node",
}


class OneLineParser(argparse.ArgumentParser):
    """A subcommand's parser (``mpsrun bench``, ``doctor``, ``status``, ``cleanup``): a usage error is one line, as the
    main command's is, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        hint = _suggestion(message, self._option_string_actions)
        self.exit(ExitCode.USAGE, escaped(f"{self.prog}: error: {message}{hint} (see {self.prog} --help)") + "\n")


def _suggestion(message: str, flags: Iterable[str]) -> str:
    """`` (did you mean --tag-output?)`` for a mistyped option (Python 3.14's argparse does this itself), or what
    mpsrun takes for another launcher's option."""
    unknown = message.partition("unrecognized arguments: ")[2].split()
    for word in unknown[:1]:
        name = word.split("=", 1)[0]
        if re.fullmatch(r"-[A-Za-z][0-9]+", name):  # a short option glued to its number: -N4
            name = name[:2]
        if name in _FOREIGN:
            return f" ({_FOREIGN[name]})"
        import difflib  # for a mistyped option only

        close = difflib.get_close_matches(name, [f for f in flags if f.startswith("--")], n=1)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


def build_parser(description: str = "", epilog: str = "", version: str = "") -> argparse.ArgumentParser:
    parser = _Parser(prog="mpsrun", usage="mpsrun [options] [--] command [args...]\n"
                     "       mpsrun [options] -m module [args...]", description=description, epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    for name, spec in options().items():
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": spec.help}
        if not spec.takes_value:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=spec.parse, metavar=spec.metavar, choices=spec.choices)
            kwargs["action"] = "append" if spec.append else "store"
        parser.add_argument(*spec.flags, **kwargs)
    parser.add_argument("--version", action="version", version=f"mpsrun {version}")
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into mpsrun's options and the command, the way mpirun does.

    Options end at the first word that is not an option (or its value), at ``--``, or
    after ``-m MODULE`` (the words after it are the module's arguments).
    """
    takes_value = {flag for spec in options().values() if spec.takes_value for flag in spec.flags}
    words: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return words, list(argv[index + 1 :])
        if not word.startswith("-") or word == "-":
            return words, list(argv[index:])
        if _GLUED_NP.fullmatch(word):  # -np4 is -np 4 (argparse would read -n "p4")
            word = f"-np={word[3:]}"
        name = word.split("=", 1)[0]
        if name in takes_value and "=" not in word and index + 1 < len(argv) and argv[index + 1] != "--":
            value = argv[index + 1]
            # --opt=value lets a value start with "-" (argparse would take it for an option).
            words.extend([f"{word}={value}"] if word.startswith("--") else [word, value])
            index += 1
            if name == "-m":
                return words, list(argv[index + 1 :])
        else:
            words.append(word)
        index += 1
    return words, []


def _from_variable(spec: Option, text: str) -> Any:
    if not spec.takes_value:
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


def _overridden(name: str, given: Mapping[str, Any]) -> bool:
    """Whether the command line sets an option that excludes ``name`` (the command line wins)."""
    return any(name in group and any(other in given for other in group if other != name) for group in EXCLUSIVE)


def parse_options(words: Sequence[str], environ: Mapping[str, str], version: str = "") -> dict[str, Any]:
    """The option values from option words, then ``MPSRUN_*`` variables for options they do not give."""
    given = vars(build_parser(version=version).parse_args(list(words)))
    found: dict[str, Any] = {}
    for name, spec in options().items():
        if name in given:
            found[name] = tuple(given[name]) if spec.append else given[name]
        elif spec.env and spec.variable in environ and not _overridden(name, given):
            found[name] = _from_variable(spec, environ[spec.variable])
    if found.get("verbose") and found.get("quiet"):
        raise ConfigError("-v/--verbose and -q/--quiet cannot be used together", setting="--quiet")
    if found.get("hosts") and found.get("hostfile"):
        raise ConfigError("give --hosts or --hostfile, not both", setting="--hosts")
    return found


def parse_args(argv: Sequence[str], environ: Mapping[str, str], version: str = "") -> JobConfig:
    """Turn a command line (and ``MPSRUN_*`` variables for options it does not give) into a JobConfig.

    Raises :class:`ConfigError` for anything invalid; argparse's SystemExit for --help/--version.
    """
    words, command = split_argv(argv)
    found = parse_options(words, environ, version)
    if "exports" in found:
        found["exports"] = values.resolve_exports(found["exports"], environ)
    if found.get("module") is not None:
        command = [sys.executable, "-m", found["module"], *command]
    _check_farm(found, command)
    if not command and found.get("tasks") is None:
        raise ConfigError("no command given: mpsrun [options] [--] command [args...]", setting="command")
    return JobConfig(command=tuple(command), **found)


#: The ways of running ranks a farm does not take (it runs its slots itself: one mpsrun per node, as
#: ``srun --ntasks-per-node=1`` starts it).
_NOT_IN_A_FARM = {"per_node": "--per-node", "hosts": "--hosts", "hostfile": "--hostfile"}


def _check_farm(found: Mapping[str, Any], command: Sequence[str]) -> None:
    """What a farm's options must agree on (ConfigError, exit 2, otherwise)."""
    tasks, array = found.get("tasks"), found.get("array")
    if tasks is None and array is None:
        given = [options()[name].flags[-1] for name in FARM_OPTIONS if found.get(name)]  # (not --tasks, --array)
        if given:
            raise ConfigError(f"{given[0]} is an option of a farm: give --tasks FILE or --array A-B", setting=given[0])
        return
    if tasks is not None and array is not None:
        raise ConfigError("give --tasks or --array, not both", setting="--tasks")
    if tasks is not None and command:
        raise ConfigError(f"--tasks takes each task's command from its file: no command after the options (found "
                          f"{command[0]!r})", setting="--tasks")
    if array is not None and not command:
        raise ConfigError("--array runs a command once per index: give it after the options", setting="--array")
    if found.get("resume") and not found.get("results"):
        raise ConfigError("--resume reads the results file: give --results FILE.jsonl", setting="--resume")
    if tasks is not None and found.get("results") and _same_file(tasks, found["results"]):
        raise ConfigError("--results names the task file: the results would be appended to the tasks",
                          setting="--results")
    if found.get("report"):
        raise ConfigError("--report is a job's report of its ranks: a farm records each task in --results FILE.jsonl",
                          setting="--report")
    refused = [flag for name, flag in _NOT_IN_A_FARM.items() if found.get(name)]
    refused += ["--launcher mpiexec"] if found.get("launcher") == "mpiexec" else []
    if refused:
        raise ConfigError(f"a farm runs its slots itself, one mpsrun per node: not with {refused[0]} (on several "
                          "nodes: srun --ntasks-per-node=1 mpsrun -np N --tasks FILE)", setting=refused[0])


def _same_file(path: str, other: str) -> bool:
    """Whether ``path`` (``-``: standard input) and ``other`` are one file."""
    with contextlib.suppress(OSError):
        return os.path.samestat(os.fstat(0) if path == "-" else os.stat(path), os.stat(other))
    return False
