"""The performance study behind docs/benchmarks.md (run on a GPU machine).

    python benchmarks/study.py OUTDIR [SECTION ...]

SECTION is any of table, hand, overhead, teardown, scale, limits, memory (default: these),
or scale2 (two GPUs).
Writes OUTDIR/study.json. Every figure is a median of repeats after warm-up, and the
figures a ratio is made of are measured side by side in the same run.
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
from collections.abc import Callable
from pathlib import Path

from mpsrun import mps_session
from mpsrun.mps import gpus as gpu_info
from mpsrun.tools import bench

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROBE = REPO / "tests" / "programs" / "gpu_probe.py"
LAUNCHES, REPEATS = 20, 3
results: dict[str, object] = {}


def say(text: str) -> None:
    print(f"study: {text}", file=sys.stderr, flush=True)


def mpsrun(*args: object) -> list[str]:
    return [sys.executable, "-m", "mpsrun", *map(str, args)]


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kwargs)  # type: ignore[call-overload,no-any-return]


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start


def median_of(n: int, fn: Callable[[], float]) -> tuple[float, list[float]]:
    samples = [fn() for _ in range(n)]
    return statistics.median(samples), samples


class Study:
    def __init__(self) -> None:
        self.gpu = gpu_info.visible_gpus()[0]
        driver = gpu_info.driver_info()
        results["machine"] = {
            "gpu": self.gpu.name,
            "driver": driver.driver_version,
            "cuda": driver.cuda_version,
            "cpu_cores": os.cpu_count(),
        }
        self.iters = bench.calibrate(8.0)
        results["kernel"] = {"iters": self.iters, "launches": LAUNCHES, "repeats": REPEATS}
        bench.measure("reference", 16, self.iters, LAUNCHES)  # warm-up, not counted

    def measure(self, mode: str, n: int, env: dict[str, str] | None = None, command: list[str] | None = None) -> float:
        value, samples = median_of(
            REPEATS, lambda: bench.measure(mode, n, self.iters, LAUNCHES, env=env, command=command)
        )
        say(f"{mode} N={n}{' (env)' if env else ''}: {value:.3f} s {[round(s, 3) for s in samples]}")
        return value

    def table(self) -> None:
        """P1, P2 and the clients' CUDA_DEVICE_MAX_CONNECTIONS, per rank count."""
        one_connection = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        rows = []
        for n in (1, 4, 8, 16, 32):
            rows.append({
                "ranks": n,
                "timesliced": self.measure("timesliced", n),
                "reference": self.measure("reference", n),
                "mps_default_connections": self.measure("mps", n),
                "mps_connections_1": self.measure("mps", n, env=one_connection),
            })
            results["table"] = rows

    def hand(self) -> None:
        """P3: MPS started by hand (nvidia-cuda-mps-control -d in its own directories) around the same ranks."""
        tmp = Path(tempfile.mkdtemp(prefix="hand", dir="/tmp"))
        env = {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(tmp / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(tmp / "log"),
            "CUDA_VISIBLE_DEVICES": self.gpu.uuid,
        }
        for name in ("pipe", "log"):
            (tmp / name).mkdir()
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
        try:
            command = [sys.executable, str(HERE / "fanout.py"), "8"]
            results["hand_mps_n8"] = {
                "hand": self.measure("hand", 8, env=env, command=command),
                "mpsrun": self.measure("mps", 8),
            }
        finally:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, timeout=60, check=False)
            shutil.rmtree(tmp, ignore_errors=True)

    def overhead(self) -> None:
        """P4: a trivial 4-rank job under mpsrun against bare mpiexec (and MPS on/off with the local launcher)."""
        trivial = [sys.executable, "-c", "pass"]
        report: dict[str, object] = {}
        mpiexec = shutil.which("mpiexec")
        if mpiexec:
            bare, bare_samples = median_of(7, lambda: timed([mpiexec, "-n", "4", "--allow-run-as-root", *trivial]))
            ours, our_samples = median_of(7, lambda: timed(mpsrun("-q", "-np", 4, "--launcher", "mpiexec", *trivial)))
            report["mpiexec"] = {"bare": bare, "mpsrun": ours, "added": ours - bare,
                                 "bare_samples": bare_samples, "mpsrun_samples": our_samples}
        off, _ = median_of(7, lambda: timed(mpsrun("-q", "-np", 4, "--launcher", "local", "--mps", "off", *trivial)))
        on, _ = median_of(7, lambda: timed(mpsrun("-q", "-np", 4, "--launcher", "local", *trivial)))
        report["local"] = {"mps_off": off, "mps_on": on, "added_by_mps": on - off}
        results["overhead_np4"] = report
        say(f"overhead: {report}")

    def teardown(self) -> None:
        """P5: from the last rank's exit until the daemon is gone and the directories removed."""
        samples = []
        for _ in range(7):
            session = mps_session(gpu=0, mps="on").start()
            client = [sys.executable, "-c", "import cupy; cupy.zeros(1).sum()"]
            subprocess.run(client, env={**os.environ, **session.env()}, check=True)
            start = time.perf_counter()
            session.close()
            samples.append(time.perf_counter() - start)
        results["teardown_s"] = {"median": statistics.median(samples), "samples": samples}
        say(f"teardown: {statistics.median(samples) * 1000:.0f} ms")

    def scale(self) -> None:
        """P6: 64 ranks on one GPU, each verified as an MPS client."""
        start = time.perf_counter()
        out = run(mpsrun("-v", "--mps", "on", "-np", 64, "--launcher", "local", sys.executable, PROBE, "--seconds", 10))
        found = re.search(r"(\d+) of (\d+) rank\(s\) verified[^\n]*", out.stderr)
        results["scale_64"] = {"exit": out.returncode, "verified": found.group(0) if found else None,
                               "wall_s": time.perf_counter() - start, "stderr_tail": out.stderr[-1500:]}
        say(f"scale: {results['scale_64']}")

    def scale2(self) -> None:
        """P6 on two GPUs: 48 ranks per GPU (the MPS client limit), each verified."""
        start = time.perf_counter()
        out = run(mpsrun("-v", "--mps", "on", "-np", 96, "--gpus", "all", "--launcher", "local", sys.executable, PROBE,
                         "--seconds", 10))
        found = re.search(r"(\d+) of (\d+) rank\(s\) verified[^\n]*", out.stderr)
        results["scale_96_two_gpus"] = {"exit": out.returncode, "verified": found.group(0) if found else None,
                                        "wall_s": time.perf_counter() - start, "stderr_tail": out.stderr[-1500:]}
        say(f"scale2: {results['scale_96_two_gpus']}")

    def limits(self) -> None:
        """Per-rank thread percentages, --mem-limit failing one rank only, and the example with and without MPS."""
        example = REPO / "examples" / "per_rank_limits.py"
        for launcher in ("local", "mpiexec"):
            out = run(mpsrun("-v", "--mps", "on", "-np", 2, "--launcher", launcher, "--thread-percentage", "25,75",
                             sys.executable, example))
            results[f"per_rank_limits_{launcher}"] = {"exit": out.returncode, "stdout": out.stdout,
                                                      "stderr": out.stderr[-1500:]}
        code = (
            "import os, cupy; r = int(os.environ['RANK']); cupy.zeros(1).sum(); "
            "x = cupy.empty((3 if r == 1 else 1) << 30, dtype=cupy.uint8); print('allocated', x.nbytes >> 20, 'MiB')"
        )
        out = run(mpsrun("--mps", "on", "-np", 2, "--launcher", "local", "--mem-limit", "2G", "--tag-output",
                         sys.executable, "-c", code))
        results["mem_limit"] = {"exit": out.returncode, "stdout": out.stdout[-1000:], "stderr": out.stderr[-2500:]}
        for mps in ("on", "off"):
            out = run(mpsrun("--mps", mps, "-np", 8, sys.executable, REPO / "examples" / "sim.py"))
            results[f"sim_np8_mps_{mps}"] = {"exit": out.returncode, "stdout": out.stdout,
                                             "stderr": out.stderr[-1500:]}
        say("limits: " + json.dumps({k: v for k, v in results.items() if k.startswith(("per_rank", "mem", "sim"))}))

    def memory(self) -> None:
        """Device memory per MPS client and for the server, as NVML reports it."""
        import pynvml

        with mps_session(gpu=0, mps="on") as session:
            hold = [sys.executable, "-c", "import cupy, time; cupy.zeros(1).sum(); print(flush=True); time.sleep(30)"]
            clients = [subprocess.Popen(hold, stdout=subprocess.PIPE, text=True) for _ in range(4)]
            try:
                for client in clients:
                    assert client.stdout is not None
                    client.stdout.readline()  # its context exists
                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByUUID(self.gpu.uuid)
                used = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
                pynvml.nvmlShutdown()
            finally:
                for client in clients:
                    client.kill()
                    client.wait()
            servers = session.daemons[0].server_pids
        results["memory_mib"] = {
            "per_client": [used[c.pid] / 2**20 for c in clients if used.get(c.pid)],
            "server": [used[p] / 2**20 for p in servers if used.get(p)],
        }
        say(f"memory: {results['memory_mib']}")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "study-out")
    out.mkdir(parents=True, exist_ok=True)
    order = ["table", "hand", "overhead", "teardown", "scale", "limits", "memory", "scale2"]
    chosen = [name for name in order if name in (sys.argv[2:] or order[:-1])]
    study = Study()
    for name in chosen:
        getattr(study, name)()
        (out / "study.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
