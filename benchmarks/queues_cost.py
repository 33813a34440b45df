"""What each MPS client's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) cost when it starts and ends.

    python benchmarks/queues_cost.py     (ROUNDS=3, NS=1,8,16)

N CuPy processes under one MPS server started by hand (as benchmarks/overhead.py's ``hand``), each asking C
queues (unset: MPS's default), in a shuffled order each round. Each process times its context (``cudaFree(0)``)
and one small fill; per cell, medians over the rounds of: ``ctx``, the median process's context; ``ctxmax``, the
slowest; ``ctx_span``, first context asked to last made; ``exit``, the last process's work done to the job's end;
``wall``, the job. Cells whose queues exceed the GPU's budget (mpsrun.mps.limits.GPU_CONNECTIONS) are left out.
The figures go to docs/benchmarks.md.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # the hand-started server, as overhead.py measures it

OUTDIR = tempfile.mkdtemp(prefix="queues-cost-")
PROGRAM = ("import time, os, json; import cupy; t0 = time.time(); cupy.cuda.runtime.free(0); t1 = time.time(); "
           "a = cupy.empty(1 << 20, dtype=cupy.uint8); a.fill(1); cupy.cuda.runtime.deviceSynchronize(); "
           f"t2 = time.time(); open(os.path.join({OUTDIR!r}, str(os.getpid())), 'w').write(json.dumps([t0, t1, t2]))")
QUEUES = (None, 1, 2, 4, 8)


def job(clients: int, queues: int | None, env: dict[str, str]) -> dict[str, float]:
    for name in os.listdir(OUTDIR):
        os.unlink(os.path.join(OUTDIR, name))
    extra = {} if queues is None else {"CUDA_DEVICE_MAX_CONNECTIONS": str(queues)}
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM], env={**env, **extra}) for _ in range(clients)]
    if any(proc.wait() for proc in procs):
        raise RuntimeError(f"a client failed ({clients} x {queues} queues)")
    end = time.time()
    times = [json.loads(Path(OUTDIR, name).read_text()) for name in os.listdir(OUTDIR)]
    return {"ctx": statistics.median(t[1] - t[0] for t in times), "ctxmax": max(t[1] - t[0] for t in times),
            "ctx_span": max(t[1] for t in times) - min(t[0] for t in times),
            "exit": end - max(t[2] for t in times), "wall": end - start}


def main() -> None:
    counts = [int(n) for n in os.environ.get("NS", "1,8,16").split(",")]
    rounds, rng = int(os.environ.get("ROUNDS", "3")), random.Random(5)  # noqa: S311 (an order, not a secret)
    cells = [(n, q) for n in counts for q in QUEUES if not (q and n * q > 120)]
    results: dict[tuple[int, int | None], list[dict[str, float]]] = {cell: [] for cell in cells}

    def every_round(env: dict[str, str]) -> None:
        for _ in range(rounds):
            for clients, queues in rng.sample(cells, len(cells)):
                results[clients, queues].append(job(clients, queues, env))
    overhead.hand(every_round)
    for (clients, queues), rows in results.items():
        medians = {key: round(statistics.median(row[key] for row in rows), 3) for key in rows[0]}
        print(f"n={clients:3d} conns={queues!s:4s}", medians)


if __name__ == "__main__":
    main()
