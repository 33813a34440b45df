"""Where a job's wall time goes: each rank's start and end against the job's, for every variant of overhead.py.

    python benchmarks/startup_trace.py [--repeats 3] [--only trivial|real]

Each rank prints the wall clock when its code starts and when it ends; mpsrun runs with ``-v``
(its phases, in seconds from its own start). Prints, per run: when the first and last rank
started, when the last one ended, and when the job ended, in ms from the job's start. A tool for
finding the time, not a benchmark: the figures go to docs/benchmarks.md only through overhead.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

STAMP = "import time as _t, os as _o; _o.write(1, f'T0 {_t.time()}\\n'.encode())"
END = "_o.write(1, f'T1 {_t.time()}\\n'.encode())"


def rank_command(real: bool, iters: int, launches: int) -> list[str]:
    if not real:
        return [sys.executable, "-c", f"{STAMP}; {END}"]
    body = overhead.KERNEL_JOB[2].replace("import sys;", f"import sys; {STAMP};", 1).replace(
        "dtype=cupy.float32); ", "dtype=cupy.float32); _o.write(1, f'TC {_t.time()}\\n'.encode()); ", 1)
    return [sys.executable, "-c", f"{body}; {END}", str(iters), str(launches)]


def run_captured(job) -> tuple[float, float, str]:
    """Run ``job`` with fd 1 and 2 going to a file; (start, end, what it printed)."""
    import tempfile
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            start = time.time()
            job()
            end = time.time()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return start, end, out.read().decode(errors="replace")


def summary(start: float, end: float, text: str) -> str:
    lines = text.splitlines()
    t0, tc, t1 = (sorted(float(line.split()[1]) for line in lines if line.startswith(tag + " "))
                  for tag in ("T0", "TC", "T1"))
    ms = lambda t: f"{(t - start) * 1000:6.0f}"  # noqa: E731
    phases = " ".join(line.split("mpsrun: ", 1)[1].replace(" after ", "=").removesuffix(" s")
                      for line in lines if " after " in line and line.startswith("mpsrun: "))
    context = f"context {ms(tc[0])}-{ms(tc[-1])} " if tc else ""
    return (f"first start {ms(t0[0]) if t0 else '-'} last start {ms(t0[-1]) if t0 else '-'} "
            f"{context}last end {ms(t1[-1]) if t1 else '-'} job end {ms(end)}  {phases}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("trivial", "real"))
    parser.add_argument("--variants", help="comma-separated names (default: all)")
    args = parser.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(overhead.REPO / "mpsrun")], check=True,
                   stdout=subprocess.DEVNULL)
    variants = dict(overhead.VARIANTS)
    variants["mpsrun local"] = overhead.mpsrun("-v", "--launcher", "local")
    variants["mpsrun mpiexec"] = overhead.mpsrun("-v", "--launcher", "mpiexec")
    for real in (False, True):
        if args.only == ("real" if real else "trivial") or args.only is None:
            n = 8 if real else 4
            iters = overhead.calibrate(8.5) if real else 0
            command = rank_command(real, iters, 200)
            print(f"== {'real' if real else 'trivial'} job, {n} ranks", flush=True)
            for name, make in variants.items():
                if args.variants and name not in args.variants.split(","):
                    continue
                if real and name in ("bare mpiexec", "mpsrun local --mps off"):
                    continue
                job = make(n, command)
                run_captured(job)  # warm-up
                for _ in range(args.repeats):
                    print(f"{name:24s} {summary(*run_captured(job))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
