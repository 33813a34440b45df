"""How many of the ranks' output lines arrive mixed, on each path: 4 ranks print 2,000 lines each at once.

    python benchmarks/mixed_lines.py [--rounds 3]

Each job runs with and without ``PYTHONUNBUFFERED=1``, through ``mpsrun`` (``--launcher local``, ``--launcher
mpiexec``, ``--hosts localhost``, ``mpiexec ... mpsrun --per-node``) and bare ``mpiexec``; a line that is not one
whole line of one rank counts as mixed.
The program is the one tests/test_output_lines.py prints with. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from mpsrun.job.mpiexec import detect_flavour

TOGETHER = ("import os, sys, time\nr = os.environ.get('RANK') or os.environ.get('OMPI_COMM_WORLD_RANK') or "
            "os.environ.get('PMI_RANK')\nopen(os.path.join(sys.argv[1], r), 'w').close()\n"
            "while len(os.listdir(sys.argv[1])) < 4:\n    time.sleep(0.001)\n")
PRINTS = TOGETHER + "for i in range(2000):\n    print('rank', r, 'line', i, 'x' * (i * 37 % 300))\n"
LINE = re.compile(r"rank \d+ line \d+(?: x*)?")


def mpiexec() -> list[str]:
    exe = shutil.which("mpiexec") or "mpiexec"
    root = ["--allow-run-as-root", "--oversubscribe"] if detect_flavour(exe) == "openmpi" and os.geteuid() == 0 else []
    return [exe, *root, "-n", "4"]


def mixed(argv: list[str], unbuffered: bool) -> tuple[int, int]:
    """(mixed lines, all lines) of one job."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as flags:
        out = subprocess.run([*argv, sys.executable, "-c", PRINTS, flags], env=env, capture_output=True, text=True,
                             timeout=300)
    lines = out.stdout.splitlines()
    return sum(LINE.fullmatch(line) is None for line in lines), len(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mpsrun = [sys.executable, "-m", "mpsrun", "-np", "4"]
    paths = {"mpsrun --launcher local": [*mpsrun, "--launcher", "local"],
             "mpsrun --launcher mpiexec": [*mpsrun, "--launcher", "mpiexec"],
             "mpsrun --hosts localhost": [*mpsrun, "--hosts", "localhost"],
             "mpiexec mpsrun --per-node": [*mpiexec(), sys.executable, "-m", "mpsrun", "--per-node"],
             "bare mpiexec": mpiexec()}
    print("| path | PYTHONUNBUFFERED | mixed lines of 8,000, each round |\n|---|---|---|")
    for name, argv in paths.items():
        for unbuffered in (False, True):
            counts = [mixed(argv, unbuffered) for _ in range(args.rounds)]
            print(f"| {name} | {'1' if unbuffered else 'unset'} | "
                  f"{', '.join(f'{bad} of {total}' for bad, total in counts)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
