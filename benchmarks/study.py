"""The performance study behind docs/benchmarks.md (run on a GPU machine).

    python benchmarks/study.py OUTDIR

Measures, side by side in one run, the figures P1-P6 of docs/benchmarks.md and writes
OUTDIR/study.json and OUTDIR/study.md. Each figure is a median of repeats after warm-up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpsrun import bench, mps_session
from mpsrun import gpus as gpu_info

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "study-out")
OUT.mkdir(parents=True, exist_ok=True)
results: dict[str, object] = {}


def say(text: str) -> None:
    print(f"study: {text}", file=sys.stderr, flush=True)


def save() -> None:
    (OUT / "study.json").write_text(json.dumps(results, indent=1))


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start


def median_of(n: int, fn) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    samples = [fn() for _ in range(n)]
    return statistics.median(samples), samples


def hand_mps_command(pipe: Path, log: Path, uuid: str) -> tuple[list[str], dict[str, str]]:
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(log),
        "CUDA_VISIBLE_DEVICES": uuid,
    }
    return [sys.executable, str(HERE / "fanout.py")], env


def main() -> int:
    gpu = gpu_info.visible_gpus()[0]
    driver = gpu_info.driver_info()
    results["machine"] = {
        "gpu": gpu.name,
        "driver": driver.driver_version,
        "cuda": driver.cuda_version,
        "cpu_cores": os.cpu_count(),
    }
    iters = bench.calibrate(8.0)
    launches, repeats = 20, 3
    results["kernel"] = {"iters": iters, "launches": launches, "repeats": repeats}
    bench.measure("reference", 16, iters, launches)  # warm-up, not counted

    def m(mode: str, n: int, env: dict[str, str] | None = None, command: list[str] | None = None) -> float:
        value, samples = median_of(repeats, lambda: bench.measure(mode, n, iters, launches, env=env, command=command))
        say(f"{mode} N={n} {'env' if env else ''}: {value:.3f} s {[round(s, 3) for s in samples]}")
        return value

    # P1/P2 and the connection setting: all measured in this one run.
    cdmc1 = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    table = []
    for n in (1, 4, 8, 16, 32):
        row = {"ranks": n, "timesliced": m("timesliced", n), "reference": m("reference", n)}
        row["mps_default_connections"] = m("mps", n)
        row["mps_connections_1"] = m("mps", n, env=cdmc1)
        table.append(row)
        results["table"] = table
        save()
    # P3: MPS started by hand (nvidia-cuda-mps-control -d, its own directories) around the same ranks.
    tmp = Path(tempfile.mkdtemp(prefix="hand", dir="/tmp"))
    pipe, log = tmp / "pipe", tmp / "log"
    pipe.mkdir()
    log.mkdir()
    command, env = hand_mps_command(pipe, log, gpu.uuid)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    try:
        hand = {
            "default": m("hand", 8, env=env, command=command),
            "connections_1": m("hand", 8, env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, command=command),
        }
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, timeout=60, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    results["hand_mps_n8"] = hand
    save()
    # P4: launcher overhead on a trivial job.
    trivial = [sys.executable, "-c", "pass"]
    mpiexec = shutil.which("mpiexec")
    overhead: dict[str, object] = {}
    if mpiexec:
        bare, bare_s = median_of(7, lambda: timed([mpiexec, "-n", "4", "--allow-run-as-root", *trivial]))
        ours, ours_s = median_of(
            7, lambda: timed([sys.executable, "-m", "mpsrun", "-q", "-np", "4", "--launcher", "mpiexec", *trivial])
        )
        overhead["mpiexec"] = {
            "bare": bare,
            "mpsrun": ours,
            "added": ours - bare,
            "bare_samples": bare_s,
            "mpsrun_samples": ours_s,
        }
    plain, _ = median_of(
        7,
        lambda: timed(
            [sys.executable, "-m", "mpsrun", "-q", "-np", "4", "--launcher", "local", "--mps", "off", *trivial]
        ),
    )
    local, _ = median_of(
        7, lambda: timed([sys.executable, "-m", "mpsrun", "-q", "-np", "4", "--launcher", "local", *trivial])
    )
    overhead["local"] = {"mps_off": plain, "mps_on": local, "added_by_mps": local - plain}
    results["overhead_np4"] = overhead
    say(f"overhead: {overhead}")
    save()
    # P5: teardown after the last rank has exited: daemon gone and directories removed.
    teardown = []
    for _ in range(7):
        session = mps_session(gpu=0, mps="on").start()
        subprocess.run(
            [sys.executable, "-c", "import cupy; cupy.zeros(1).sum()"], env={**os.environ, **session.env()}, check=True
        )
        start = time.perf_counter()
        session.close()
        teardown.append(time.perf_counter() - start)
    results["teardown_s"] = {"median": statistics.median(teardown), "samples": teardown}
    say(f"teardown: {statistics.median(teardown) * 1000:.0f} ms")
    save()
    # P6: scale: 64 ranks, every one verified as an MPS client.
    probe = REPO / "tests" / "programs" / "gpu_probe.py"
    start = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsrun",
            "-v",
            "--mps",
            "on",
            "-np",
            "64",
            "--launcher",
            "local",
            sys.executable,
            str(probe),
            "--seconds",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = re.search(r"(\d+) of (\d+) rank\(s\) verified", out.stderr)
    results["scale_64"] = {
        "exit": out.returncode,
        "verified": found.group(0) if found else None,
        "wall_s": time.perf_counter() - start,
        "stderr_tail": out.stderr[-1500:],
    }
    say(f"scale: {results['scale_64']['verified']} exit {out.returncode}")
    save()
    # Memory: per-client device memory under MPS, and --mem-limit failing one rank only.
    code = (
        "import os, cupy; r = int(os.environ['RANK']); cupy.zeros(1).sum(); "
        "x = cupy.empty((3 if r == 1 else 1) << 30, dtype=cupy.uint8); print('rank', r, 'allocated')"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsrun",
            "--mps",
            "on",
            "-np",
            "2",
            "--launcher",
            "local",
            "--mem-limit",
            "2G",
            "--tag-output",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    results["mem_limit"] = {"exit": out.returncode, "stdout": out.stdout[-1000:], "stderr": out.stderr[-2000:]}
    with mps_session(gpu=0, mps="on") as session:
        clients = [
            subprocess.Popen([sys.executable, "-c", "import cupy,time; cupy.zeros(1).sum(); time.sleep(8)"])
            for _ in range(4)
        ]
        time.sleep(6)
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        used = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        pynvml.nvmlShutdown()
        per_client = [used.get(c.pid) for c in clients]
        server = [used[p] for p in session.daemons[0].server_pids if p in used]
        for c in clients:
            c.wait()
    # Per-rank thread percentages, and the example simulation with and without MPS.
    for launcher in ("local", "mpiexec"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "mpsrun",
                "-v",
                "--mps",
                "on",
                "-np",
                "2",
                "--launcher",
                launcher,
                "--thread-percentage",
                "25,75",
                sys.executable,
                str(REPO / "examples" / "per_rank_limits.py"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        results[f"per_rank_limits_{launcher}"] = {
            "exit": out.returncode,
            "stdout": out.stdout,
            "stderr": out.stderr[-1500:],
        }
    for mps in ("on", "off"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "mpsrun",
                "--mps",
                mps,
                "-np",
                "8",
                sys.executable,
                str(REPO / "examples" / "sim.py"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        results[f"sim_np8_mps_{mps}"] = {"exit": out.returncode, "stdout": out.stdout, "stderr": out.stderr[-1500:]}
    results["memory_mib"] = {
        "per_client": [v / 2**20 if v else None for v in per_client],
        "server": [v / 2**20 for v in server],
    }
    say(f"memory: {results['memory_mib']}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
