"""Where a job's wall time goes, outside and inside its ``-v`` phases, for several source trees in the same rounds.

    python benchmarks/startup_split.py NAME=TREE [NAME=TREE ...]   (NP=4, LAUNCHERS="local mpiexec", ROUNDS=10)

Each tree's ``mpsrun -v -np NP --launcher L python3 -c pass`` is run in turn, ROUNDS times, reading its
``mpsrun: ... after S s`` lines as they come. Per tree and launcher, medians of: ``start``, from the exec to the
job's own clock (the interpreter, mpsrun's imports, the options); ``job``, from there to ``torn down``; ``end``, from
``torn down`` to the process's exit; ``ranks``, from ``ranks starting`` to ``ranks done``; and the wall time. A tool
for finding the time, not a benchmark: the figures go to docs/benchmarks.md only through overhead.py.
"""

import os
import re
import statistics
import subprocess
import sys
import time

PHASE = re.compile(r"mpsrun: (.*) after ([0-9.]+) s")


def one_run(tree: str, launcher: str, ranks: str) -> tuple[float, ...]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([tree, *filter(None, os.environ.get("EXTRA_PATH", "").split(os.pathsep))])}
    start = time.perf_counter()
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-v", "-np", ranks, "--launcher", launcher,
                            sys.executable, "-c", "pass"], env=env, cwd="/tmp", stderr=subprocess.PIPE,
                           stdout=subprocess.DEVNULL, text=True, bufsize=1)
    origin, stamps = None, {}
    for line in job.stderr:
        now = time.perf_counter() - start
        if match := PHASE.search(line):
            stamps[match.group(1)] = now
            origin = now - float(match.group(2)) if origin is None else origin
    job.wait()
    end = time.perf_counter() - start
    torn = stamps.get("torn down", end)
    origin = torn if origin is None else origin
    return origin, torn - origin, end - torn, stamps.get("ranks done", 0) - stamps.get("ranks starting", 0), end


def main() -> None:
    trees = {name: os.path.abspath(path) for name, path in (item.split("=", 1) for item in sys.argv[1:])}
    ranks, rounds = os.environ.get("NP", "4"), int(os.environ.get("ROUNDS", "10"))
    for tree in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "mpsrun")], check=True)
    for launcher in os.environ.get("LAUNCHERS", "local mpiexec").split():
        rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                rows[name].append(one_run(tree, launcher, ranks))
        for name, runs in rows.items():
            start, job, end, ranked, wall = ([value * 1000 for value in column] for column in zip(*runs, strict=True))
            print(f"{launcher} {ranks} {name}: start {statistics.median(start):.0f} ms (min {min(start):.0f}), job "
                  f"{statistics.median(job):.0f} ms, end {statistics.median(end):.0f} ms, ranks "
                  f"{statistics.median(ranked):.0f} ms (min {min(ranked):.0f}), wall {statistics.median(wall):.0f} ms "
                  f"(min {min(wall):.0f} max {max(wall):.0f})", flush=True)


if __name__ == "__main__":
    main()
