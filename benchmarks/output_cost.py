"""What passing every rank's output on in whole lines costs (issue 48): a job whose ranks print many short lines.

    python benchmarks/output_cost.py [--rounds 5] [--lines 1000000] TREE [TREE...]

Each TREE is a checkout of mpsrun (run from there with PYTHONPATH, ``-m mpsrun``); the rounds alternate between them.
Each job is 4 ranks of ``sys.stdout.write("line %d\\n")`` LINES times, its stdout read by ``cat`` into /dev/null,
block-buffered and with PYTHONUNBUFFERED=1, under the local and the mpiexec launcher. Printed: each case's wall time
and CPU time (every process of the job, reaped), median (min-max) in seconds. Needs ``mpiexec`` on PATH, no GPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

PROGRAM = "import sys\nw = sys.stdout.write\nfor i in range(int(sys.argv[1])):\n    w('line %d\\n' % i)\n"


def one_job(tree: str, launcher: str, unbuffered: bool, lines: int) -> tuple[float, float]:
    """Wall and CPU seconds of one job (its output through a pipe into cat)."""
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "4", "--mps", "off", "--launcher", launcher,
                            sys.executable, "-c", PROGRAM, str(lines)], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, env=env, cwd="/")
    sink = subprocess.run(["cat"], stdin=job.stdout, stdout=subprocess.DEVNULL, check=True)
    assert job.stdout is not None
    job.stdout.close()
    if job.wait() != 0 or sink.returncode != 0:
        raise SystemExit(f"{tree}: the job failed ({job.returncode})")
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("trees", nargs="+")
    args = parser.parse_args()
    cases = [(launcher, unbuffered) for launcher in ("local", "mpiexec") for unbuffered in (False, True)]
    times: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            for launcher, unbuffered in cases:
                times.setdefault((tree, launcher, unbuffered), []).append(
                    one_job(tree, launcher, unbuffered, args.lines))
    print("| tree | launcher | output | wall s | CPU s |\n|---|---|---|---|---|")
    for (tree, launcher, unbuffered), runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"| {tree} | {launcher} | {'unbuffered' if unbuffered else 'buffered'} | "
              f"{statistics.median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f}) | "
              f"{statistics.median(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) |")


if __name__ == "__main__":
    main()
