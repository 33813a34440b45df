"""A Monte-Carlo ensemble over one shared table: every rank samples the same large lookup table, held once per GPU.

    mpsrun -np 8 python examples/shared_table.py [--mib 1024] [--samples 20000000]

Each rank of an ensemble needs the same read-only table (here a synthetic cross-section table with
a resonance; in practice one loaded from a file). With ``mpsrun.shared.api`` the first rank on each GPU
builds it and the others map that one copy: 8 ranks of a 1 GiB table use 1 GiB of device memory,
not 8. Each rank then draws its own samples (its own seed) and estimates the table's mean.

Without a GPU (or without CuPy) the table is shared host memory and the ranks use NumPy; the first
call of ``shared.array`` says so.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy

from mpsrun import shared


def build_table(out) -> None:
    """The table's contents: a smooth background with a narrow resonance, computed where the table lives."""
    xp = numpy if isinstance(out, numpy.ndarray) else __import__("cupy")
    energy = xp.linspace(0.0, 1.0, out.size, dtype=out.dtype)
    out[...] = 1.0 + 50.0 / (1.0 + ((energy - 0.37) / 0.002) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="table size in MiB (float32)")
    parser.add_argument("--samples", type=int, default=20_000_000)
    args = parser.parse_args()
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    n = args.mib * (1 << 20) // 4
    if rank == 0:  # the table and the draws take a while on a CPU (seconds per GiB): say what happens meanwhile
        print(f"rank 0/{size}: {args.mib} MiB table, made once per GPU (or host) and shared; {args.samples:,} draws "
              "a rank", flush=True)
    started = time.perf_counter()
    table = shared.array("xs-table", (n,), "float32", init=build_table)
    had = time.perf_counter() - started
    xp = numpy if isinstance(table, numpy.ndarray) else __import__("cupy")
    draws = xp.random.RandomState(1234 + rank).randint(0, n, args.samples)
    estimate = float(table[draws].astype(xp.float64).mean())
    exact = float(table.astype(xp.float64).mean()) if rank == 0 else None
    where = "host (NumPy)" if xp is numpy else "GPU (CuPy)"
    print(f"rank {rank}/{size}: table of {args.mib} MiB on the {where} in {had:.3f} s; mean estimate {estimate:.5f}"
          + (f" (exact {exact:.5f})" if exact is not None else ""), flush=True)


if __name__ == "__main__":
    main()
