"""The in-rank shim: ``python -m mpsrun.rank -- COMMAND [ARGS...]``.

mpiexec starts this once per rank. It reads the rank's place on its node from the
launcher's variables (``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``,
``SLURM_LOCALID``, ...), applies that rank's environment from the plan file that
mpsrun wrote (``$MPSRUN_PLAN``), records its pid for mpsrun's MPS-client check, and
``exec``s the command, which so keeps the MPI environment (``COMM_WORLD.size == N``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mpsrun.mpi import LOCAL_RANK_VARIABLES, RANK_VARIABLES, SIZE_VARIABLES, first_int

EXIT_SETUP = 3
EXIT_NOT_FOUND = 127


def rank_environment(env: Mapping[str, str], plan: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The environment for this process: ours plus the plan's entry for our local rank."""
    local = first_int(env, LOCAL_RANK_VARIABLES)
    if local is None:
        names = ", ".join(LOCAL_RANK_VARIABLES)
        raise LookupError(f"no local-rank variable from the MPI launcher (looked for {names})")
    if local >= len(plan):
        raise LookupError(f"local rank {local} has no entry in mpsrun's plan ({len(plan)} ranks on this node)")
    result = {**env, **plan[local]}
    rank = first_int(env, RANK_VARIABLES)
    size = first_int(env, SIZE_VARIABLES)
    result["LOCAL_RANK"] = str(local)
    result["RANK"] = str(local if rank is None else rank)
    result["MPSRUN_RANK"] = result["RANK"]
    if size is not None:
        result["WORLD_SIZE"] = str(size)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("mpsrun.rank: usage: python -m mpsrun.rank -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    plan_file = os.environ.get("MPSRUN_PLAN")
    try:
        if not plan_file:
            raise LookupError("MPSRUN_PLAN is not set (this shim is started by mpsrun)")
        plan = json.loads(Path(plan_file).read_text())["ranks"]
        env = rank_environment(os.environ, plan)
    except (LookupError, OSError, ValueError) as exc:
        print(f"mpsrun.rank: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    program = shutil.which(args[0], path=env.get("PATH"))
    if program is None:
        print(f"mpsrun.rank: error: {args[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    ranks_dir = os.environ.get("MPSRUN_RANKS_DIR")
    if ranks_dir:  # lets mpsrun map this pid (kept across exec) to the rank
        Path(ranks_dir, f"{env['RANK']}.pid").write_text(str(os.getpid()))
    os.execve(program, args, env)  # does not return


if __name__ == "__main__":
    sys.exit(main())
