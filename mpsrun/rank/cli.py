"""A rank supervisor's command line: ``python -m mpsrun.rank [--rank R --local-rank L --size N --local-size M] --
COMMAND...``.

The identity options are the local launcher's (whose forked supervisors call :func:`main` with them); under an MPI
launcher the rank reads its identity from the launcher's variables. See :mod:`mpsrun.rank.supervisor`.
"""

import os
import sys
from collections.abc import Sequence

from mpsrun.exitcodes import ExitCode
from mpsrun.rank.identity import RankIdentity, identity_from_env
from mpsrun.rank.join import direct
from mpsrun.rank.supervisor import run_rank, say_line
from mpsrun.runtime.constants import CONTROL_VARIABLE, TOKEN_VARIABLE, WORLD_VARIABLE

__all__ = ["main"]

USAGE = "usage: python -m mpsrun.rank [--rank R --local-rank L --size N --local-size M] -- COMMAND"


def _parse(argv: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """The identity options (``--name N`` pairs, as mpsrun writes them) and the command."""
    words = list(argv)
    if "--" not in words:
        raise SystemExit(USAGE)
    split = words.index("--")
    pairs = words[:split]
    if len(pairs) % 2:
        raise SystemExit(USAGE)
    options: dict[str, int] = {}
    for name, value in zip(pairs[::2], pairs[1::2], strict=True):
        if name not in ("--rank", "--local-rank", "--size", "--local-size") or not value.isdecimal():
            raise SystemExit(USAGE)
        options[name[2:].replace("-", "_")] = int(value)
    return options, words[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Supervise the rank the arguments (or the launcher's variables) name; this process's exit code."""
    options, command = _parse(sys.argv[1:] if argv is None else argv)
    address, token = os.environ.get(CONTROL_VARIABLE), os.environ.get(TOKEN_VARIABLE, "")
    if not command or not address:
        say_line(f"python -m mpsrun.rank runs a rank of a job started by mpsrun; it needs {CONTROL_VARIABLE} and a "
                 "command")
        return ExitCode.USAGE
    local = "rank" in options and "local_rank" in options  # the local launcher's, not an MPI launcher's
    if local:
        identity: RankIdentity | None = RankIdentity(options["rank"], options["local_rank"], options.get("size"),
                                                     options.get("local_size"))
    else:
        identity = identity_from_env(os.environ)
    if identity is None:
        say_line("no local-rank variable from the MPI launcher "
                 "(OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, ...)")
        return ExitCode.SETUP
    # The local launcher says why it is the launcher (see mpsrun.rank.pyrun's WorldWatch); any other is an MPI one.
    world = os.environ.get(WORLD_VARIABLE, "local") if local else "mpi"
    return run_rank(command, identity, direct(address), token, world)

