"""Multi-stream programs under MPS: each rank's hardware queues (issue 40).

    python benchmarks/hyperq.py [--ranks 1,4,8,12,16] [--rounds 3] [--json FILE]   the table
    python benchmarks/hyperq.py --probe DIR [--json FILE]                            the server's queue budget
    python benchmarks/hyperq.py --sweep 96,128,129,160,256 [--rounds 3]            kernels at once, one process
    python benchmarks/hyperq.py --worker [--streams 32] [--ms 10] [--sync DIR]      one rank

The workload is the CUDA samples' simpleHyperQ, with our own kernel: on each of 32 streams, two
one-block kernels that each spin for 10 ms, the second after the first. With enough hardware queues
every stream runs at once (about 20 ms in all); with Q queues, streams beyond Q wait behind others
(CUDA gives a plain process 8 queues, an MPS client 2 unless CUDA_DEVICE_MAX_CONNECTIONS says more).
Five times, the ranks meet at a start line (``--sync``), so that their kernels run at the same time,
and each times its own first launch to its last kernel's end; a job's figure is the median over the
five of its slowest rank's time (``together``: of the time from the first rank's start to the last
rank's end). ``--sweep`` runs one process alone with one kernel per stream on 96 to 256 streams: how
many kernels the GPU runs at once.

The table runs, in each round and in a shuffled order: one process alone (no mpsrun); mpsrun under
MPS with MPS's default of 2 queues (``-x CUDA_DEVICE_MAX_CONNECTIONS=2``); mpsrun under MPS with the
planned count (``--queues auto``); mpsrun time-sliced (``--mps off``). Every job runs on GPU 0. The
figure of a job is its slowest rank's. ``--probe`` starts jobs of N clients with C queues each and
says which started (clients x queues around the budget), one server per GPU and one serving two.
Nothing here is a pass/fail test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KERNEL = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
ME = str(Path(__file__).resolve())
MPSRUN = [sys.executable, "-m", "mpsrun"]


def worker(streams: int, ms: float, sync: str | None, pairs: bool = True, repeats: int = 5) -> None:
    """One rank: warm up, then ``repeats`` times meet the others and time its streams' kernels.

    Each repeat's start and end are read from CLOCK_MONOTONIC, one clock for every process of the
    machine, so the job can say how long all its ranks took together in each repeat.
    """
    import cupy

    if os.environ.get("HYPERQ_DEVICE") == "local":  # --gpu-bind none: the rank picks its device
        cupy.cuda.Device(int(os.environ["LOCAL_RANK"]) % cupy.cuda.runtime.getDeviceCount()).use()
    kernel = cupy.RawKernel(KERNEL, "spin")
    cycles = int(ms * _cycles_per_ms(cupy, kernel))
    queues = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)]
    spans = []
    for repeat in range(repeats):
        _meet(sync, repeat)
        start = time.clock_gettime(time.CLOCK_MONOTONIC)
        for stream in queues:
            for _ in range(2 if pairs else 1):
                kernel((1,), (1,), (cupy.int64(cycles),), stream=stream)
        cupy.cuda.Device().synchronize()
        spans.append((start, time.clock_gettime(time.CLOCK_MONOTONIC)))
    line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "spans": spans,
                       "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")})
    os.write(1, (line + "\n").encode())


def _cycles_per_ms(cupy: Any, kernel: Any) -> float:
    """The clock as the kernel sees it, timed alone (compiles and warms the kernel up too)."""
    kernel((1,), (1,), (cupy.int64(1000),))
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    kernel((1,), (1,), (cupy.int64(10_000_000),))
    end.record()
    end.synchronize()
    return 10_000_000 / float(cupy.cuda.get_elapsed_time(start, end))


def _meet(sync: str | None, repeat: int) -> None:
    """Wait until every rank has reached this repeat's start line (a file each in ``sync``)."""
    if sync is None or os.environ.get("HYPERQ_APART"):  # HYPERQ_APART: each rank starts when it is ready
        return
    size = int(os.environ.get("WORLD_SIZE", 1))
    Path(sync, f"{repeat}.{os.environ.get('RANK', 0)}").touch()
    deadline = time.monotonic() + 120
    while sum(name.startswith(f"{repeat}.") for name in os.listdir(sync)) < size and time.monotonic() < deadline:
        time.sleep(0.0005)


def job(argv: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> dict[str, object]:
    """Run one job: its exit status, the median of its slowest rank's times and what it said last."""
    sync = tempfile.mkdtemp(prefix="hyperq-")
    try:
        done = subprocess.run([*argv, "--sync", sync], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    finally:
        shutil.rmtree(sync, ignore_errors=True)
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    repeats = list(zip(*(rank["spans"] for rank in ranks), strict=True))
    slowest = [max(end - start for start, end in spans) for spans in repeats]
    together = [max(end for _, end in spans) - min(start for start, _ in spans) for spans in repeats]
    return {"rc": done.returncode, "ranks": len(ranks), "slowest": statistics.median(slowest) if slowest else None,
            "together": statistics.median(together) if together else None, "each": slowest,
            "connections": sorted({r["connections"] for r in ranks}, key=str), "said": done.stderr[-3000:]}


def sweep(counts: list[int], rounds: int) -> dict[str, list[dict[str, object]]]:
    """One process alone, one kernel on each of N streams: N kernels that may all run at once."""
    found: dict[str, list[dict[str, object]]] = {}
    for round_ in range(rounds):
        for count in counts:
            result = job([sys.executable, ME, "--worker", "--single", "--streams", str(count)])
            found.setdefault(str(count), []).append(result)
            print(f"round {round_} {count:>3} streams rc={result['rc']} median={result['slowest']}", flush=True)
    return found


def variants(count: int, single: bool = False) -> dict[str, list[str]]:
    work = [sys.executable, ME, "--worker", *(["--single"] if single else [])]
    on = [*MPSRUN, "-np", str(count), "--gpus", "0", "--mps", "on"]
    return {"alone": work, "mps 2 queues": [*on, "-x", "CUDA_DEVICE_MAX_CONNECTIONS=2", *work],
            "mps planned": [*on, "--queues", "auto", *work],
            "time-sliced": [*MPSRUN, "-np", str(count), "--gpus", "0", "--mps", "off", *work]}


def table(counts: list[int], rounds: int, seed: int, single: bool) -> dict[str, dict[str, list[dict[str, object]]]]:
    rng = random.Random(seed)  # noqa: S311 (an order, not a secret)
    found: dict[str, dict[str, list[dict[str, object]]]] = {}
    for round_ in range(rounds):
        for count in counts:
            jobs = list(variants(count, single).items())
            rng.shuffle(jobs)
            for name, argv in jobs:
                result = job(argv)
                found.setdefault(str(count), {}).setdefault(name, []).append(result)
                print(f"round {round_} {count:>2} ranks {name:<13} rc={result['rc']} slowest={result['slowest']} "
                      f"queues={result['connections']}", flush=True)
    return found


PROBES = [(14, 8), (15, 8), (16, 8), (7, 16), (8, 16), (28, 4), (29, 4), (30, 4), (3, 32), (4, 32), (37, 3),
          (38, 3), (48, 2)]
if os.environ.get("HYPERQ_PROBES"):  # e.g. 42x3,21x6
    PROBES = [tuple(map(int, pair.split("x"))) for pair in os.environ["HYPERQ_PROBES"].split(",")]  # type: ignore


def _special(folder: str, names: list[str]) -> list[str]:
    """Sockets and pipes: not copied."""
    return [name for name in names if not os.path.isdir(os.path.join(folder, name))
            and not os.path.isfile(os.path.join(folder, name))]


def probe(keep: Path) -> list[dict[str, object]]:
    """Jobs of N clients with C queues each on one server: which start; then one server over both GPUs."""
    found = []
    work = [sys.executable, ME, "--worker", "--streams", "1", "--ms", "1"]
    cases = [(n, c, ["--gpus", "0"]) for n, c in PROBES]
    cases += [(n, c, ["--gpus", "0,1", "--gpu-bind", "none"]) for n, c in ((8, 16), (16, 8), (14, 16), (15, 16))]
    for clients, queues, where in cases:
        logs = keep / f"{clients}x{queues}{'-2gpus' if len(where) > 2 else ''}"
        argv = [*MPSRUN, "-np", str(clients), *where, "--mps", "on", "--keep-logs", "-v",
                "-x", f"CUDA_DEVICE_MAX_CONNECTIONS={queues}", *work]
        base = tempfile.mkdtemp(prefix="hq")  # short: the MPS pipes are sockets
        try:
            result = job(argv, {"HYPERQ_DEVICE": "local", "MPSRUN_TMPDIR": base})
        finally:
            shutil.copytree(base, logs, symlinks=True, ignore=_special)
            shutil.rmtree(base, ignore_errors=True)
        result.update(clients=clients, queues=queues, gpus=where[1])
        print(f"{clients:>2} clients x {queues:>2} = {clients * queues:>3} on {where[1]}: rc={result['rc']} "
              f"ranks that ran {result['ranks']}", flush=True)
        found.append(result)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--ms", type=float, default=10.0)
    parser.add_argument("--sync")
    parser.add_argument("--single", action="store_true", help="one kernel per stream, not a pair (no dependencies: "
                        "every kernel of a rank can run at once)")
    parser.add_argument("--ranks", default="1,4,8,12,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--probe", type=Path, metavar="DIR", help="keep each probe job's logs under DIR")
    parser.add_argument("--sweep", metavar="N,N,...", help="one process, one kernel on each of N streams")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.streams, args.ms, args.sync, pairs=not args.single)
        return 0
    if args.probe is not None:
        args.probe.mkdir(parents=True, exist_ok=True)
        result: object = probe(args.probe)
    elif args.sweep:
        result = sweep([int(n) for n in args.sweep.split(",")], args.rounds)
    else:
        result = table([int(n) for n in args.ranks.split(",")], args.rounds, args.seed, args.single)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
