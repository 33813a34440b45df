"""A farm of small tasks on one GPU: ``mpsrun --tasks`` against ``xargs -P`` with and without MPS (issue 50).

    python benchmarks/farm.py [--tasks 200] [--slots 8] [--gpu-seconds 1.0 | --launches N] [--repeats 3] [--seed 7]
                              [--json FILE]

Two farms, each run every way side by side, in alternating rounds (each round runs every variant once, in an order
drawn from ``--seed``):

- kernels: ``--tasks`` tasks of ``benchmarks/tune_kernels.py small --launches N`` (8-block kernels, a sliver of the
  GPU; N is calibrated first to ``--gpu-seconds`` of GPU time alone, by ``tune_kernels.py small --calibrate``,
  unless ``--launches`` gives it; 1000, the old default, was under 0.5 s on an H200), ``--slots`` at a time:
  ``xargs -P`` time-sliced, ``xargs -P`` under MPS started by a shell script (benchmarks/mps_by_script.sh,
  as a site's wrapper does it), and ``mpsrun -np SLOTS --array`` (its own daemon, every task proven a client);
- true: 1,000 tasks of ``true``: ``xargs -P`` against ``mpsrun --array`` (what a task costs mpsrun itself).

Each figure is the wall time of the whole farm from this process. Nothing here is a pass/fail test: the figures go to
docs/benchmarks.md, with the card's name.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from rounds import report, timed_rounds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def variants(tasks: int, slots: int, launches: int) -> dict[str, list[str]]:
    """Each variant's command line."""
    kernel = [sys.executable, str(HERE / "tune_kernels.py"), "small", "--launches", str(launches)]
    xargs = ["xargs", "-P", str(slots), "-I{}", *kernel]
    seq = ["sh", "-c", f"seq 0 {tasks - 1} | " + " ".join(xargs)]
    mpsrun = [sys.executable, "-m", "mpsrun", "-q", "--mps", "on", "-np", str(slots)]
    return {
        "kernels: xargs -P, time-sliced": seq,
        "kernels: xargs -P, MPS by script": ["bash", str(HERE / "mps_by_script.sh"), "1", "local", *seq],
        "kernels: mpsrun --array": [*mpsrun, "--array", f"0-{tasks - 1}", *kernel],
        "true: xargs -P": ["sh", "-c", f"seq 1000 | xargs -P {slots} -n 1 true"],
        "true: mpsrun --array": [*mpsrun, "--array", "0-999", "true"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--gpu-seconds", type=float, default=1.0, help="each kernel task's GPU time alone")
    parser.add_argument("--launches", type=int, help="each kernel task's launches (instead of --gpu-seconds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.launches is None:
        calibrate = [sys.executable, str(HERE / "tune_kernels.py"), "small", "--calibrate", str(args.gpu_seconds)]
        args.launches = int(subprocess.run(calibrate, check=True, capture_output=True, text=True).stdout)
        print(f"calibrated: {args.launches} launches for {args.gpu_seconds} s", file=sys.stderr, flush=True)
    runs = variants(args.tasks, args.slots, args.launches)
    seconds = timed_rounds(runs, args.repeats, args.seed, ROOT)
    report(seconds, vars(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
