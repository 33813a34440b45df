"""Two workloads whose best mpsrun setting is known, for checking ``mpsrun tune`` on a GPU.

    python benchmarks/tune_kernels.py small --launches N     # 8 blocks of 256 threads: a sliver of the GPU
    python benchmarks/tune_kernels.py fill --launches N      # every SM full
    python benchmarks/tune_kernels.py small --calibrate 1.0  # the launches that take about 1 s alone

Each run does a fixed amount of work (``--launches`` kernels of ``--iters`` dependent multiply-adds per
thread), so ``mpsrun tune --scaling weak`` compares settings on equal work per rank; with ``--split`` the
ranks share the launches (``WORLD_SIZE`` parts), for ``--scaling strong``. ``small`` leaves most SMs
idle: under MPS, ranks' kernels run side by side, so MPS with the most ranks should win several times over
time-slicing. ``fill`` sizes its grid from the SM count: one rank keeps the GPU busy, and no setting should beat
one rank beyond the noise.
"""

from __future__ import annotations

import argparse
import os
import time

import cupy

SOURCE = r"""
extern "C" __global__ void spin(float* out, int iters) {
    float x = threadIdx.x * 1e-3f, y = 1.0f;
    for (int i = 0; i < iters; ++i) { x = x * 0.999999f + y; y = y * 0.999999f + 1e-6f; }
    out[blockIdx.x * blockDim.x + threadIdx.x] = x + y;
}
"""
THREADS = 256


def blocks(mode: str) -> int:
    if mode == "small":
        return 8
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return sms * (2048 // THREADS)  # as many resident threads as every SM holds


def run(mode: str, launches: int, iters: int) -> float:
    kernel = cupy.RawKernel(SOURCE, "spin")
    grid = blocks(mode)
    out = cupy.empty(grid * THREADS, dtype=cupy.float32)
    kernel((grid,), (THREADS,), (out, cupy.int32(iters)))  # compiled and loaded before the clock starts
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        kernel((grid,), (THREADS,), (out, cupy.int32(iters)))
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["small", "fill"])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--split", action="store_true", help="do 1/WORLD_SIZE of the launches (strong scaling)")
    parser.add_argument("--calibrate", type=float, metavar="SECONDS",
                        help="print the --launches that take about SECONDS alone, and exit")
    args = parser.parse_args()
    if args.calibrate:
        seconds = run(args.mode, 20, args.iters) / 20
        print(max(1, round(args.calibrate / seconds)))
        return
    launches = -(-args.launches // int(os.environ.get("WORLD_SIZE", "1"))) if args.split else args.launches
    seconds = run(args.mode, launches, args.iters)
    print(f"kernels: {seconds:.3f} s for {launches} launches of {blocks(args.mode)} blocks")


if __name__ == "__main__":
    main()
