"""Small CuPy tasks from Python: ``mpsrun.Executor`` against ``ProcessPoolExecutor`` with and without MPS (issue 51).

    python benchmarks/executor.py [--task sum|spin] [--tasks 2000] [--workers 8] [--size N] [--repeats 3]
                                  [--seed 5] [--without VARIANT]... [--json FILE]

Each round runs every variant once, in an order drawn from ``--seed``, each in a fresh process of its own (so no
variant inherits another's CUDA state), and times the whole of it from this process:

- ``Executor``: ``mpsrun.Executor(workers=N)`` (its daemon, its workers placed and kept);
- ``ProcessPoolExecutor``: ``ProcessPoolExecutor(N)`` with spawned workers, time-sliced;
- ``ProcessPoolExecutor in mps_session``: the same inside ``mps_session()``, MPS by hand;
- ``mpsrun --array``: the same tasks as fresh processes (a farm), each paying for its interpreter and context.

A ``sum`` task is a few small CuPy kernels on ``--size`` floats (default 65536): the GPU is idle most of the time,
and the figures measure the pools themselves. A ``spin`` task is 20 launches of a kernel of 8 blocks that spins for
``--size`` GPU clock cycles (default 2,000,000, about 1 ms): a sliver of the GPU, busy, where time-slicing costs and
MPS does not. Nothing here is a pass/fail test: the figures go to docs/benchmarks.md, with the card's name.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from rounds import report, timed_rounds

ROOT = Path(__file__).resolve().parent.parent

TASKS = {
    "sum": ("""
def task(seed, size={size}):
    import cupy
    x = cupy.random.default_rng(seed).random(size, dtype=cupy.float32)
    for _ in range(8):
        x = cupy.sin(x) * 0.5 + x * 0.5
    return float(x.sum())
""", 1 << 16),
    # (no empty braces in the kernel: --array puts the task's index in place of "{{}}" in its arguments)
    "spin": ("""
def task(seed, size={size}):
    import cupy
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n)
        {{ long long t = clock64(); while (clock64() - t < n) {{ ; }} }}''', "spin")
    for _ in range(20):
        spin((8,), (128,), (cupy.int64(size),))
    cupy.cuda.Device().synchronize()
    return seed
""", 2_000_000),
}

POOL = """
import concurrent.futures, multiprocessing, sys
{task}
def main():
    {enter}
    with {pool} as pool:
        total = sum(pool.map(task, range({tasks}), chunksize=1))
    print(total)
if __name__ == "__main__":
    main()
"""


def programs(kind: str, tasks: int, workers: int, size: int, where: Path) -> dict[str, list[str]]:
    """Each variant's command line; the pools' programs are files in ``where`` (spawned workers import their main
    module, which ``python -c`` has not)."""
    task = TASKS[kind][0].format(size=size)
    spawn = "multiprocessing.get_context('spawn')"
    pools = {
        "Executor": ("", f"__import__('mpsrun').Executor(workers={workers}, mps='on')"),
        "ProcessPoolExecutor": ("", f"concurrent.futures.ProcessPoolExecutor({workers}, mp_context={spawn})"),
        "ProcessPoolExecutor in mps_session": (
            "import mpsrun; session = mpsrun.mps_session(gpu=0).__enter__()",
            f"concurrent.futures.ProcessPoolExecutor({workers}, mp_context={spawn})"),
    }
    runs = {}
    for number, (name, (enter, pool)) in enumerate(pools.items()):
        program = where / f"pool{number}.py"
        program.write_text(POOL.format(task=task, enter=enter, pool=pool, tasks=tasks))
        runs[name] = [sys.executable, str(program)]
    one = task + "\nimport os\ntask(int(os.environ['MPSRUN_TASK_ID']))\n"
    runs["mpsrun --array"] = [sys.executable, "-m", "mpsrun", "-q", "--mps", "on", "-np", str(workers), "--array",
                              f"0-{tasks - 1}", sys.executable, "-c", one]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="sum")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--size", type=int, help="floats of a sum task, cycles of a spin kernel")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--without", action="append", default=[], help="leave this variant out (repeatable)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    args.size = args.size or TASKS[args.task][1]
    where = Path(tempfile.mkdtemp(prefix="mpsrun-bench-"))
    runs = programs(args.task, args.tasks, args.workers, args.size, where)
    for name in args.without:
        del runs[name]
    seconds = timed_rounds(runs, args.repeats, args.seed, ROOT)
    report(seconds, vars(args), args.json)
    shutil.rmtree(where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
