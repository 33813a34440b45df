"""What ``mpsrun top`` costs as the ranks it shows grow, and as the machine's other processes grow (no GPU needed).

    python benchmarks/top_scale.py [--ranks 50,200,400,1000] [--extra 0,2000] [--repeats 5] [--json FILE]

A job's session is planted as a job makes it (a record naming N rank processes, each a ``sleep`` with the
environment mpsrun gives a rank), on a fake GPU (tests/fake_nvml) that lists a CUDA context for every rank; M more
``sleep`` processes stand for the rest of a busy machine. Two figures, each min / median / max of the repeats:

- ``refresh``: one look and its table (``Top.snapshot`` and ``render``) in this process, as the live view does every
  ``--interval`` (1 s by default): it must stay well under the interval;
- ``once``: ``mpsrun top --once`` from start to end (the interpreter, the imports, the 0.5 s CPU window, one look).

The fake NVML reads a file per context on every call (real NVML asks the driver once): its share is in the figures.
To measure another checkout, put it first: ``PYTHONPATH=/path/to/checkout python benchmarks/top_scale.py``.
Every process it starts is its own child, ended by pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE_NVML = ROOT / "tests" / "fake_nvml"
UUID = "GPU-00000000-fake-4000-8000-000000000000"


def _sleepers(count: int, env: dict[str, str] | None = None, ranks: bool = False) -> list[subprocess.Popen]:
    """``count`` sleeping processes (each leads its group when ``ranks``: a rank's record names its group)."""
    started = []
    for rank in range(count):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "CUDA_VISIBLE_DEVICES": UUID,
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{UUID}=4G", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
        started.append(subprocess.Popen(["sleep", "3600"], env={**(env or os.environ), **(rank_env if ranks else {})},
                                        start_new_session=ranks))
    return started


@contextlib.contextmanager
def planted_job(base: Path, nvml: Path, count: int) -> Iterator[list[subprocess.Popen]]:
    """A running job of ``count`` ranks as mpsrun records one under ``base``, each with a context on the fake GPU."""
    from mpsrun.runtime.processes import ProcessRef

    session = base / f"mpsrun-{os.getuid()}" / "sbench"
    session.mkdir(mode=0o700, parents=True)
    ranks = _sleepers(count, ranks=True)
    try:
        record = {"kind": "job", "owner": ProcessRef.of(os.getpid())._asdict(), "uid": os.getuid(),
                  "started": time.time(), "gpus": [UUID], "argv": ["mpsrun", "-np", str(count), "python", "sim.py"],
                  "ranks": [ProcessRef.of(p.pid)._asdict() for p in ranks]}
        (session / "session.json").write_text(json.dumps(record))
        (nvml / "procs").mkdir(exist_ok=True)
        for p in ranks:
            (nvml / "procs" / str(p.pid)).write_text(json.dumps({"uuid": UUID, "type": "M+C", "mib": 1030}))
        yield ranks
    finally:
        _end(ranks)
        shutil.rmtree(session)
        shutil.rmtree(nvml / "procs", ignore_errors=True)


def _end(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def _spread(seconds: list[float]) -> dict[str, float]:
    return {"min": round(min(seconds), 3), "median": round(statistics.median(seconds), 3),
            "max": round(max(seconds), 3)}


def _refresh(base: Path, repeats: int) -> list[float]:
    from mpsrun.tools import top

    view = top.Top(base)
    if hasattr(view, "prime"):
        view.prime()
    else:  # an older top: its first look started the CPU measure
        view.snapshot()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        snapshot = view.snapshot()
        top.render(snapshot)
        times.append(time.perf_counter() - began)
    if not all(row.memory for row in snapshot.ranks):
        raise SystemExit("a rank's device memory was not found: the figures would not be of a whole look")
    return times


def _once(base: Path, count: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "mpsrun", "top", "--once", "--tmpdir", str(base)],
                             capture_output=True, text=True, timeout=3600, cwd=base)  # not this checkout's mpsrun
        times.append(time.perf_counter() - began)
        if out.returncode != 0 or f" {count} rank(s) " not in out.stdout:
            raise SystemExit(f"mpsrun top --once did not show the {count} ranks: {(out.stdout + out.stderr)[-2000:]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="50,200,400,1000")
    parser.add_argument("--extra", default="0,2000", help="other processes on the machine, one run for each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--once-repeats", type=int, default=None, help="repeats of --once (default: --repeats)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tb", dir="/tmp"))
    nvml = work / "nvml"
    nvml.mkdir()
    (nvml / "gpus.json").write_text(json.dumps([{"uuid": UUID, "name": "Fake H100", "memory_total": 80 << 30}]))
    base = work / "t"
    base.mkdir(mode=0o700)
    os.environ.update(MPSRUN_FAKE_NVML=str(nvml), PYTHONPATH=os.pathsep.join(
        [str(FAKE_NVML), *filter(None, [os.environ.get("PYTHONPATH")])]))
    sys.path.insert(0, str(FAKE_NVML))
    import mpsrun

    results = {"mpsrun": str(Path(mpsrun.__file__).parent), "cpus": os.cpu_count(), "runs": []}
    try:
        for extra in map(int, args.extra.split(",")):
            others = _sleepers(extra)
            try:
                for count in map(int, args.ranks.split(",")):
                    with planted_job(base, nvml, count):
                        run = {"ranks": count, "extra_processes": extra,
                               "processes_on_machine": len([p for p in os.listdir("/proc") if p.isdigit()]),
                               "refresh_s": _spread(_refresh(base, args.repeats)),
                               "once_s": _spread(_once(base, count, args.once_repeats or args.repeats))}
                    results["runs"].append(run)
                    print(json.dumps(run), flush=True)
            finally:
                _end(others)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
