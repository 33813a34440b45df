"""An mpi4py program for the MPI tier: prints what each rank sees, checks a collective."""

import json
import os
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1, op=MPI.SUM)
info = {
    "size": comm.size,
    "rank": comm.rank,
    "sum": total,
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                                            "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")},
}
if os.environ.get("PROBE_DIR"):  # a file per rank: MPI launchers may interleave output lines
    with open(os.path.join(os.environ["PROBE_DIR"], f"{info['rank']}.json"), "w") as out:
        json.dump(info, out)
print("PROBE " + json.dumps(info), flush=True)
sys.exit((int(os.environ.get("PROBE_EXIT_RANK", "-1")) == comm.rank and 7) or 0)
