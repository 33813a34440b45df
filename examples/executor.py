"""mpsrun.Executor: a sweep of small GPU tasks on four workers that share GPU 0 through MPS.

    python examples/executor.py

The workers are placed as a job's ranks are (here with thread_percentage="auto": 25% of the SMs each), each a
client of the executor's private MPS daemon, and they stay: each keeps its CUDA context and CuPy's compiled kernels
from one task to the next. Without a GPU the executor says so once and the workers run on NumPy.
"""

from __future__ import annotations

import concurrent.futures

import mpsrun


def work(seed: int) -> float:
    """One task: the mean of x^2 over 1M uniform draws."""
    try:
        import cupy as xp

        xp.zeros(1).sum()  # the worker's CUDA context (its first task makes it): a client of its GPU's server
    except Exception:  # no CuPy, or no GPU it can use
        import numpy as xp
    values = xp.random.default_rng(seed).random(1 << 20, dtype=xp.float32)
    return float((values * values).mean())


def main() -> int:
    with mpsrun.Executor(workers=4, gpus="0", thread_percentage="auto") as executor:
        futures = {executor.submit(work, seed): seed for seed in range(16)}
        results = {futures[future]: future.result() for future in concurrent.futures.as_completed(futures)}
        accounts = executor.accounts()
        mps = "on" if executor.session.enabled else "off"
    print(f"mean of x^2 over {len(results)} tasks: {sum(results.values()) / len(results):.4f} (expected 0.3333)")
    proven = sum(account.mps is True for account in accounts)
    print(f"MPS {mps}; {proven} of {len(accounts)} workers proven MPS clients; calls per worker: "
          f"{[account.calls for account in accounts]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
