"""Device memory and attach time: every rank loading its own copy of a table, against mpsrun.shared.api.

    python benchmarks/shared_memory.py [--ranks 16] [--gib 2] [--big-gib 60] [--json FILE]

For each way (own copy, shared), ``mpsrun -np RANKS`` runs ranks that each get the table (own: allocate
and fill it; shared: ``shared.array``, filled once per GPU), report how long that took, and wait. Once
every rank holds its table, the device's used memory is read from NVML; then the ranks end. The table
is filled on the GPU (``arange``), so its time is that of device memory, not of a file system. Last,
one run shares a table too large for every rank to have its own (``--big-gib``, as arrays of at most
4 GiB: the most one shared array holds on this driver). Runs on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
PART = 4 * GIB


def rank_main(sync: Path, way: str, nbytes: int) -> int:
    import cupy

    from mpsrun import shared

    rank = os.environ["RANK"]
    fill_index = cupy.ElementwiseKernel("", "float32 y", "y = (float)(i % 1000003)", "fill_index")  # in place
    from cuda import core  # noqa: F401 - imported, like the CUDA context, before either way's time
    cupy.zeros(1).sum()  # the CUDA context first: not counted in either way's time
    cupy.cuda.Device().synchronize()
    if way == "shared" and rank != "0":  # attach once rank 0 has filled it: the attach alone is timed
        deadline = time.monotonic() + 600
        while not (sync / "filled").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    started = time.perf_counter()
    parts = -(-nbytes // PART) if way == "shared" else 1  # one shared array holds at most 4 GiB
    n = nbytes // 4 // parts
    if way == "shared":
        tables = [shared.array(f"bench-table-{p}", (n,), "float32", init=fill_index) for p in range(parts)]
    else:
        tables = [fill_index(cupy.empty(n, dtype=cupy.float32))]
    cupy.cuda.Device().synchronize()
    took = time.perf_counter() - started
    ok = all(float(t[n - 1]) == float((n - 1) % 1000003) and float(t[12345]) == 12345.0 for t in tables)
    (sync / f"ready.{rank}").write_text(json.dumps({"seconds": took, "ok": ok, "rank": int(rank)}))
    if rank == "0":
        (sync / "filled").write_text("")
    deadline = time.monotonic() + 600
    while not (sync / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return 0 if ok else 1


def used_memory() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def run(way: str, ranks: int, nbytes: int) -> dict[str, object]:
    """One job: its ranks' times to have the table, and the device memory used while they all hold it."""
    sync = Path(tempfile.mkdtemp(prefix="shared-bench-"))
    before = used_memory()
    argv = [sys.executable, "-m", "mpsrun", "-np", str(ranks), "--launcher", "local", sys.executable, __file__,
            "--rank", way, "--sync", str(sync), "--bytes", str(nbytes)]
    job = subprocess.Popen(argv)
    deadline = time.monotonic() + 600
    while len(list(sync.glob("ready.*"))) < ranks and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    held = used_memory()
    (sync / "go").write_text("")
    code = job.wait()
    reports = [json.loads(p.read_text()) for p in sync.glob("ready.*")]
    first = [r["seconds"] for r in reports if r["rank"] == 0]
    others = sorted(r["seconds"] for r in reports if r["rank"] != 0)
    for path in sync.iterdir():
        path.unlink()
    sync.rmdir()
    return {"way": way, "ranks": ranks, "table_gib": nbytes / GIB, "exit": code,
            "all_ok": all(r["ok"] for r in reports) and len(reports) == ranks, "used_gib": (held - before) / GIB,
            "rank0_s": first[0] if first else None, "others_median_s": statistics.median(others) if others else None,
            "others_max_s": others[-1] if others else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--big-gib", type=float, default=56.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank", choices=("own", "shared"))
    parser.add_argument("--sync", type=Path)
    parser.add_argument("--bytes", type=int)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args.sync, args.rank, args.bytes)
    nbytes = int(args.gib * GIB)
    results = [run("shared", 1, nbytes)]  # warm-up: kernel caches; also what one context costs
    results = [run(way, args.ranks, nbytes) for way in ("own", "shared")] + [results[0]]
    results.append(run("shared", args.ranks, int(args.big_gib * GIB)))
    print("way: own = every rank allocates and fills its copy; shared = rank 0 fills it, the others attach")
    print(f"{'way':>7} {'ranks':>5} {'table':>8} {'used':>9} {'ok':>3} {'rank 0':>8} "
          f"{'others (median, max)':>22}")
    for r in results:
        print(f"{r['way']:>7} {r['ranks']:>5} {r['table_gib']:>6.1f}Gi {r['used_gib']:>7.2f}Gi "
              f"{str(r['all_ok'])[0]:>3} {r['rank0_s'] or 0:>7.3f}s {r['others_median_s'] or 0:>10.4f}s "
              f"{r['others_max_s'] or 0:>9.4f}s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
