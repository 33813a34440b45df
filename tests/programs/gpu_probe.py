"""A CuPy (+ mpi4py when run under MPI) rank for the GPU tier.

Runs small kernels for --seconds (long enough for mpsrun's client check to see it),
checks the result, and prints one PROBE line with what the rank saw.
"""

import argparse
import json
import os
import time

import cupy

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=3.0)
args = parser.parse_args()

x = cupy.arange(1 << 16, dtype=cupy.float32)
end = time.monotonic() + args.seconds
launches = 0
while time.monotonic() < end:
    x = x * 1.0000001 + 0.0
    launches += 1
cupy.cuda.Device().synchronize()
ok = bool(cupy.isfinite(x).all())
size, rank, total = 1, int(os.environ.get("RANK", "0")), 1
if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size, rank, total = comm.size, comm.rank, comm.allreduce(1)
info = {
    "rank": rank, "size": size, "total": total, "ok": ok, "launches": launches, "pid": os.getpid(),
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                                            "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")},
}
if os.environ.get("PROBE_DIR"):  # a file per rank: MPI launchers may interleave output lines
    with open(os.path.join(os.environ["PROBE_DIR"], f"{info['rank']}.json"), "w") as out:
        json.dump(info, out)
print("PROBE " + json.dumps(info), flush=True)
