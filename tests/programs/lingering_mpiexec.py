"""An mpiexec that, like Open MPI's mpirun, takes its time to exit after its ranks have ended.

    lingering_mpiexec.py -n N COMMAND...   (``--version`` says nothing it would recognise)

Starts N copies of COMMAND with PMI variables, waits for them, then (up to LINGER_SECONDS, 3 s)
waits for the job's MPS daemons to be gone, and writes to LINGER_REPORT whether they went while it
was still running. Exits with the highest exit code of its ranks.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def daemon_pids() -> list[int]:
    """The job's daemons, from the session record next to the controller's socket."""
    session = Path(os.environ["MPSRUN_CONTROL"].removeprefix("unix:")).parent
    record = json.loads((session / "session.json").read_text())
    return [daemon["process"]["pid"] for daemon in record["daemons"]]


def alive(pid: int) -> bool:
    """Running (a zombie has ended: its parent has yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:
        print("lingering mpiexec 1.0")
        return 0
    assert argv[0] == "-n", argv
    n, command = int(argv[1]), argv[2:]
    ranks = [subprocess.Popen(command, env={**os.environ, "PMI_RANK": str(r), "PMI_SIZE": str(n),
                                            "PMI_LOCAL_RANK": str(r), "MPI_LOCALNRANKS": str(n)})
             for r in range(n)]
    codes = [rank.wait() for rank in ranks]
    pids = daemon_pids()  # on record by now: mpsrun starts mpiexec before its daemons, its ranks after them
    assert pids, "no daemon on record"
    deadline = time.monotonic() + float(os.environ.get("LINGER_SECONDS", "3"))
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(os.environ["LINGER_REPORT"]).write_text(json.dumps({"daemons_gone": not any(alive(p) for p in pids)}))
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
