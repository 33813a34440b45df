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


def work(seed: int) -> tuple[int, float]:
    try:
        import cupy as xp

        xp.zeros(1).sum()
    except Exception:
        import numpy as xp
    rng = xp.random.default_rng(seed)
    values = rng.random(1 << 20, dtype=xp.float32)
    return os.getpid(), float((values * values).mean())


def main() -> int:
    with mps_session(gpu=0) as session:
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            results = pool.map(work, range(8))
            verified = session.verify({pid for pid, _ in results})  # the workers, while they still run
        print(f"mean of x^2 over 8 tasks: {sum(r for _, r in results) / len(results):.4f} (expected 0.3333)")
        print(f"MPS {'on' if session.enabled else 'off'}; workers verified as MPS clients: {len(verified)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
