"""When ``mpsrun --launcher mpiexec`` starts mpiexec: the command's own start on the critical path of every such job.

    python3 benchmarks/prelaunch.py [--repeats 8] [--ranks 4,48]

mpsrun runs with ``--mpiexec`` set to a wrapper that notes the time and then execs the real mpiexec; the figure is
that time less the moment mpsrun was started (its interpreter, its imports, its session's directory and reaper,
up to the launch). Also the whole job's time, and both under ``--mps off``. Seconds, median (min-max).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--ranks", default="4,48")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mpsrun-prelaunch-"))
    try:
        stamp, wrapper = work / "launched", work / "mpiexec"
        mpiexec = shutil.which("mpiexec") or "mpiexec"
        wrapper.write_text(f"#!/bin/bash\ndate +%s.%N > {stamp}\nexec {mpiexec} \"$@\"\n")
        wrapper.chmod(0o755)
        for ranks in args.ranks.split(","):
            for extra in ([], ["--mps", "off"]):
                argv = [sys.executable, "-c", "import sys; from mpsrun._entry import main; sys.argv[0] = 'mpsrun'; "
                        "main()", "-np", ranks, "--launcher", "mpiexec", "--mpiexec", str(wrapper), *extra, "--",
                        sys.executable, "-c", "pass"]
                launched, whole = [], []
                for _ in range(args.repeats + 1):  # the first is a warm-up, not counted
                    start = time.time()
                    subprocess.run(argv, check=True)
                    whole.append(time.time() - start)
                    launched.append(float(stamp.read_text()) - start)
                print(f"-np {ranks} {' '.join(extra) or '(MPS on)'}: mpiexec started after {_spread(launched[1:])}; "
                      f"the job took {_spread(whole[1:])}", flush=True)
    finally:
        shutil.rmtree(work)
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}) s"


if __name__ == "__main__":
    sys.exit(main())
