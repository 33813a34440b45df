"""Unmodified JAX, PyTorch and CuPy ranks sharing one GPU under mpsrun (GPU machine, one run).

    python benchmarks/frameworks.py [--json FILE]

For each case: the exit code, the wall time, the per-rank limit ``--mem-limit auto`` chose,
each rank's result and what its framework saw as its memory (bytes), the peak device memory in use (NVML, sampled
every 20 ms) against the GPU's total, and mpsrun's per-rank proof of MPS. Also: how much of
a 4G pinned limit one CuPy rank can allocate (MiB), and what NVML then shows it using (bytes).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time

import pynvml

PROGRAMS = {
    "jax": "import jax, jax.numpy as jnp; x = jnp.ones((4096, 4096)); y = (x @ x).block_until_ready(); "
           "print('RESULT', float(y.sum()), jax.devices()[0].memory_stats().get('bytes_limit'))",
    "torch": "import torch; x = torch.ones(4096, 4096, device='cuda'); y = x @ x; torch.cuda.synchronize(); "
             "print('RESULT', float(y.sum()), torch.cuda.mem_get_info()[0])",
    "cupy": "import cupy; x = cupy.ones((4096, 4096), dtype=cupy.float32); y = x @ x; "
            "print('RESULT', float(y.sum()), cupy.cuda.runtime.memGetInfo()[0])",
    "jax-short": "import jax.numpy as j; print('RESULT', float(j.ones(10).sum()), 0)",
}
CASES = [("jax", 4, []), ("jax", 4, ["--mem-limit", "auto"]), ("jax", 8, ["--mem-limit", "auto"]),
         ("torch", 4, ["--mem-limit", "auto"]), ("cupy", 4, ["--mem-limit", "auto"]),
         ("jax-short", 4, ["--mem-limit", "16G"])]
FILL = (
    "import cupy\n"
    "blocks = []\n"
    "try:\n"
    "    while True: blocks.append(cupy.empty(64 << 20, dtype=cupy.uint8))\n"
    "except cupy.cuda.memory.OutOfMemoryError: pass\n"
    "import os, pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
    "used = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}\n"
    "print('RESULT', len(blocks) * 64, used.get(os.getpid()))\n"
)


class PeakMemory:
    """The most device memory NVML shows in use on GPU 0 while the block runs."""

    def __enter__(self) -> PeakMemory:
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.total = pynvml.nvmlDeviceGetMemoryInfo(self.handle).total
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        pynvml.nvmlShutdown()


def run_case(program: str, ranks: int, options: list[str]) -> dict[str, object]:
    argv = [sys.executable, "-m", "mpsrun", "-np", str(ranks), "-v", "--launcher", "local", "--mps", "on",
            "--gpus", "0", *options, sys.executable, "-c", program]
    with PeakMemory() as memory:
        start = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - start
    results = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RESULT")]
    chosen = re.search(r"(\d+[MG]) pinned memory \(auto\)", out.stderr)
    proof = re.search(r"\d+ of \d+ ranks? connected to MPS.*", out.stderr)
    return {"exit": out.returncode, "wall_s": round(wall, 2), "auto_limit": chosen.group(1) if chosen else None,
            "ranks_ok": len(results), "rank_results": sorted(results),
            "peak_used_GiB": round(memory.peak / (1 << 30), 1), "total_GiB": round(memory.total / (1 << 30), 1),
            "proof": proof.group(0) if proof else None,
            "stderr_tail": out.stderr[-600:] if out.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results: dict[str, object] = {}
    for name, ranks, options in CASES:
        results[f"{name} x{ranks} {' '.join(options) or 'no limit'}"] = run_case(PROGRAMS[name], ranks, options)
        print(json.dumps(list(results.items())[-1]), flush=True)
    for limit in ("4G", "1536M"):  # 1536M: does a client's own variable keep megabytes (the daemon's does not)?
        results[f"cupy fills a {limit} limit"] = run_case(FILL, 1, ["--mem-limit", limit])
        print(json.dumps(results[f"cupy fills a {limit} limit"]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
