"""A small Monte-Carlo simulation, one piece per rank, combined with an MPI reduction.

Run it through mpsrun (the README's main job), or as the tasks of a farm, one seed each (docs/ensembles.md):

    mpsrun -np 4 python examples/sim.py
    mpsrun -np 4 --array 0-7 python examples/sim.py --seed {}

Each rank estimates pi from random points in batches of small GPU kernels (CuPy), the
kind of work that leaves most of a GPU idle and so gains from MPS. Ranks are combined
with mpi4py when the job runs under mpiexec; with mpsrun's local launcher each rank
reports its own share and rank 0 the job's size. Without a GPU or CuPy it runs the same
computation with NumPy, so the command also works on a laptop.
"""

from __future__ import annotations

import argparse
import os
import time


def array_module():
    """CuPy when a GPU is usable, else NumPy (same API for what we use)."""
    try:
        import cupy

        cupy.zeros(1).sum()  # create the context now: fails without a usable GPU
        return cupy, "GPU"
    except Exception:
        import numpy

        return numpy, "CPU"


def communicator():
    """mpi4py's COMM_WORLD when this process was started by mpiexec, else None."""
    if not any(name in os.environ for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def estimate(xp, batches: int, batch: int, seed: int) -> tuple[int, int]:
    """Points inside the quarter circle, and points drawn."""
    rng = xp.random.default_rng(seed) if hasattr(xp.random, "default_rng") else xp.random.RandomState(seed)
    inside = 0
    for _ in range(batches):
        x = rng.random(batch, dtype=xp.float32)
        y = rng.random(batch, dtype=xp.float32)
        inside += int(((x * x + y * y) <= 1.0).sum())
    return inside, batches * batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="kernel batches per rank")
    parser.add_argument("--batch", type=int, default=1 << 16, help="points per batch")
    parser.add_argument("--seed", type=int, default=None, help="the random seed (default: the rank's); one run")
    args = parser.parse_args()

    comm = communicator()
    rank = comm.rank if comm else int(os.environ.get("RANK", "0"))
    size = comm.size if comm else int(os.environ.get("WORLD_SIZE", "1"))
    xp, device = array_module()
    estimate(xp, 2, args.batch, seed=rank)  # warm-up: CuPy compiles its kernels on first use
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    inside, drawn = estimate(xp, args.batches, args.batch, seed=1234 + (rank if args.seed is None else args.seed))
    seconds = time.perf_counter() - start
    if comm is not None:
        inside = comm.allreduce(inside)
        drawn = comm.allreduce(drawn)
        seconds = comm.allreduce(seconds, op=__import__("mpi4py").MPI.MAX)
        if rank == 0:
            print(f"pi ~ {4 * inside / drawn:.6f} from {drawn} points on {size} ranks ({device}, {seconds:.2f} s)")
    elif args.seed is not None:
        print(f"seed {args.seed}: pi ~ {4 * inside / drawn:.6f} from {drawn} points ({device}, {seconds:.2f} s)")
    else:
        print(f"rank {rank}/{size}: pi ~ {4 * inside / drawn:.6f} from {drawn} points ({device}, {seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
