"""The benchmark's GPU work: one rank of ``mpsrun bench`` (or the one-process reference).

``python -m mpsrun.tools.benchwork --sync DIR --iters K [--streams S]`` (bench runs it as
:func:`mpsrun.runtime.processes.own_module` does: this installation's, wherever it is started)

Each kernel does a fixed amount of dependent arithmetic (``K`` fused multiply-adds per
thread, 8 blocks of 256 threads: a small kernel that leaves most SMs idle). Unlike a
clock-spin kernel, its time does not keep running while the context is switched out,
so time-slicing shows as lost time. After a warm-up (compilation, first launch) the
process reports ready, waits for the common start time the driver writes into
``DIR/go``, issues its launches (on ``S`` streams when ``S > 1``, the one-process
reference), synchronises, and writes its start and end times. Process start-up and
exit are therefore not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from mpsrun.exitcodes import ExitCode

KERNEL = r"""
extern "C" __global__ void fma_loop(float* out, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float x = (float)i * 1e-6f;
    for (int k = 0; k < iters; ++k) {
        x = fmaf(x, 0.9999999f, 1e-7f);
    }
    out[i] = x;
}
"""
BLOCKS, THREADS = 8, 256


def _kernel() -> tuple[Any, Any]:
    import cupy

    return cupy, cupy.RawKernel(KERNEL, "fma_loop")


def calibrate(target_ms: float) -> int:
    """Iterations per thread that make one kernel take about ``target_ms`` on this GPU, alone."""
    cupy, kernel = _kernel()
    out = cupy.empty(BLOCKS * THREADS, dtype=cupy.float32)
    iters = 1 << 16
    kernel((BLOCKS,), (THREADS,), (out, cupy.int32(iters)))  # compile and warm up
    cupy.cuda.Device().synchronize()
    while True:
        start = cupy.cuda.Event()
        end = cupy.cuda.Event()
        start.record()
        kernel((BLOCKS,), (THREADS,), (out, cupy.int32(iters)))
        end.record()
        end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end)
        if ms > target_ms / 4 or iters > 1 << 30:
            return max(1, int(iters * target_ms / ms))
        iters *= 4


def run(sync: Path, iters: int, launches: int, streams: int, ident: str) -> dict[str, object]:
    cupy, kernel = _kernel()
    outs = [cupy.empty(BLOCKS * THREADS, dtype=cupy.float32) for _ in range(streams)]
    kernel((BLOCKS,), (THREADS,), (outs[0], cupy.int32(iters)))  # warm-up: compile, first launch
    cupy.cuda.Device().synchronize()
    cuda_streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(streams)] if streams > 1 else []
    (sync / f"ready.{ident}").write_text(str(os.getpid()))
    go = sync / "go"
    deadline = time.monotonic() + 600
    while not go.exists():  # the driver writes it once every process is ready; a bounded poll
        if time.monotonic() > deadline:
            raise SystemExit("mpsrun bench worker: no start signal from the driver within 600 s")
        time.sleep(0.001)
    start_at = float(go.read_text() or 0)
    while time.time() < start_at:
        pass
    start = time.time()
    for _ in range(launches):
        if cuda_streams:
            for stream, out in zip(cuda_streams, outs, strict=True):
                with stream:
                    kernel((BLOCKS,), (THREADS,), (out, cupy.int32(iters)))
        else:
            kernel((BLOCKS,), (THREADS,), (outs[0], cupy.int32(iters)))
    cupy.cuda.Device().synchronize()
    end = time.time()
    ok = all(bool(cupy.isfinite(out).all()) for out in outs)
    result: dict[str, object] = {"start": start, "end": end, "pid": os.getpid(), "ok": ok, "streams": streams}
    (sync / f"result.{ident}.json").write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of mpsrun bench")
    parser.add_argument("--sync", type=Path)
    parser.add_argument("--iters", type=int, default=1 << 20)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--calibrate", type=float, default=None, metavar="MS")
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        print(calibrate(args.calibrate))
        return ExitCode.OK
    ident = os.environ.get("RANK", str(os.getpid()))
    result = run(args.sync, args.iters, args.launches, args.streams, ident)
    return ExitCode.OK if result["ok"] else ExitCode.FAILED


if __name__ == "__main__":
    raise SystemExit(main())
