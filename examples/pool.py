"""mps_session() with a multiprocessing pool: four workers share GPU 0 through MPS.

    python examples/pool.py

The session exports the MPS variables while it is open, so spawned workers become
clients of this script's private MPS server; verify() proves it. Without a GPU the
session says so and the workers run on NumPy.
"""

from __future__ import annotations

import multiprocessing
import os

from mpsrun import mps_session


def work(seed: int) -> tuple[int, float, bool]:
    """One task: its worker's pid, the mean of x^2 over 1M uniform draws, and whether it ran on the GPU."""
    try:
        import cupy as xp

        xp.zeros(1).sum()  # the worker's CUDA context: a client of the session's server
        on_gpu = True
    except Exception:  # no CuPy, or no GPU it can use
        import numpy as xp

        on_gpu = False
    rng = xp.random.default_rng(seed)
    values = rng.random(1 << 20, dtype=xp.float32)
    return os.getpid(), float((values * values).mean()), on_gpu


def main() -> int:
    with mps_session(gpu=0) as session:
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            results = pool.map(work, range(8))
            on_gpu = {pid for pid, _, gpu in results if gpu}
            # The workers, while they still run: verify() raises if one used the GPU without MPS.
            verified = session.verify(on_gpu) if session.enabled and on_gpu else []
        print(f"mean of x^2 over 8 tasks: {sum(r for _, r, _ in results) / len(results):.4f} (expected 0.3333)")
        print(f"MPS {'on' if session.enabled else 'off'}; workers on the GPU: {len(on_gpu)}, verified as MPS "
              f"clients: {len(verified)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
