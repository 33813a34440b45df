"""Per-rank MPS limits: each rank reports its SM cap and how long a GPU-filling kernel took.

    mpsrun -np 2 --thread-percentage 25,75 python examples/per_rank_limits.py

CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps the share of SMs a client's kernels may use (a
cap, not a reservation), so the rank capped at 25% takes about three times as long as
the one capped at 75% on the same kernel. Ranks run one after the other here (rank r
waits r seconds) so the timings do not disturb each other.

It needs an NVIDIA GPU, MPS and CuPy; without them rank 0 says so in one line and the job ends
with exit code 1.
"""

import os
import sys
import time

try:
    import cupy

    cupy.cuda.Device().attributes  # noqa: B018 - fails here, not in the middle, without a usable GPU
except Exception as exc:  # ImportError, or CuPy's own error for a missing driver or device
    if os.environ.get("RANK", "0") == "0":
        print(f"per_rank_limits.py needs CuPy and an NVIDIA GPU: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    time.sleep(30)  # the others wait to be stopped: rank 0's line is the job's one word (mpsrun ends them)
    sys.exit(1)

KERNEL = cupy.RawKernel(
    r"""
extern "C" __global__ void spin(float* out, int iters) {
    float x = threadIdx.x * 1e-6f;
    for (int k = 0; k < iters; ++k) x = fmaf(x, 0.9999999f, 1e-7f);
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
""",
    "spin",
)

rank = int(os.environ.get("RANK", "0"))
sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
blocks, threads = sms * 8, 256
out = cupy.empty(blocks * threads, dtype=cupy.float32)
KERNEL((blocks,), (threads,), (out, cupy.int32(1000)))  # compile and warm up
cupy.cuda.Device().synchronize()
time.sleep(rank * 2.0)
start = time.perf_counter()
KERNEL((blocks,), (threads,), (out, cupy.int32(4_000_000)))
cupy.cuda.Device().synchronize()
elapsed = time.perf_counter() - start
cap = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "none")
print(f"rank {rank}: thread percentage {cap}: GPU-filling kernel took {elapsed * 1000:.1f} ms")
