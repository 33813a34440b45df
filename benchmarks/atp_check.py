"""What the active-thread percentage does to a kernel (GPU machine, one run).

    python benchmarks/atp_check.py [--json FILE]

1. One MPS client runs a FIXED grid (8 blocks per SM of the whole GPU, dependent FMAs) under
   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 100 / 50 / 25. It also runs the grid sized from the SM
   count CUDA reports, which MPS lowers to the cap: that kernel shrinks with the cap, so its
   time cannot show the cap (the mistake of an earlier version of this script).
2. Four ranks of the fixed-grid kernel under ``mpsrun -np 4`` with no cap and with
   ``--thread-percentage auto`` (25% each), their kernels started together (a file barrier) so
   that they overlap: the job's wall time and each rank's kernel time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from mpsrun import mps_session

CLIENT = r"""
import json, os, sys, time, cupy
k = cupy.RawKernel(r'''
extern "C" __global__ void spin(float* out, int iters) {
    float x = threadIdx.x * 1e-6f;
    for (int i = 0; i < iters; ++i) x = fmaf(x, 0.9999999f, 1e-7f);
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}''', 'spin')
seen = cupy.cuda.Device().attributes['MultiProcessorCount']
result = {'sms_seen': seen}
iters = int(os.environ.get('ITERS', '4000000'))
grids = (('fixed_grid', int(os.environ['ALL_SMS']) * 8), ('grid_from_sms_seen', seen * 8))
for name, blocks in grids[:1] if os.environ.get('BARRIER') else grids:
    out = cupy.empty(blocks * 256, dtype=cupy.float32)
    k((blocks,), (256,), (out, cupy.int32(1000))); cupy.cuda.Device().synchronize()
    if os.environ.get('BARRIER'):  # every rank's kernel starts together, so the kernels overlap
        open(os.path.join(os.environ['BARRIER'], os.environ['RANK']), 'w').close()
        while len(os.listdir(os.environ['BARRIER'])) < int(os.environ['WORLD_SIZE']): time.sleep(0.001)
    t = time.perf_counter(); k((blocks,), (256,), (out, cupy.int32(iters))); cupy.cuda.Device().synchronize()
    result[name + '_s'] = round(time.perf_counter() - t, 4)
    result[name + '_blocks'] = blocks
sys.stdout.write(json.dumps(result) + '\n')
"""


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}


def all_sms() -> int:
    code = "import cupy; print(cupy.cuda.Device().attributes['MultiProcessorCount'])"
    return int(subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                              check=True).stdout)


def one_client(sms: int) -> dict[str, dict[str, float]]:
    results = {}
    with mps_session(gpu=0, mps="on", export=False) as session:
        for pct in (100, 50, 25):
            env = {**clean_env(), **session.env(), "ALL_SMS": str(sms), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}
            out = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, check=True)
            results[f"{pct}%"] = json.loads(out.stdout)
    return results


def four_ranks(sms: int) -> dict[str, dict[str, object]]:
    """Four ranks start the same fixed-grid kernel together (a file barrier), uncapped and under auto."""
    results: dict[str, dict[str, object]] = {}
    for label, options in (("no cap", []), ("auto (25% each)", ["--thread-percentage", "auto"])):
        argv = [sys.executable, "-m", "mpsrun", "-np", "4", "--launcher", "local", "--mps", "on", "--gpus", "0",
                *options, sys.executable, "-c", CLIENT]
        barrier = tempfile.mkdtemp(prefix="atp")
        start = time.perf_counter()
        out = subprocess.run(argv, env={**clean_env(), "ALL_SMS": str(sms), "BARRIER": barrier,
                                        "ITERS": "20000000"}, capture_output=True, text=True, check=True)
        shutil.rmtree(barrier)
        wall = time.perf_counter() - start
        ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        results[label] = {"job_wall_s": round(wall, 3),
                          "rank_fixed_grid_s": sorted(r["fixed_grid_s"] for r in ranks),
                          "sms_seen": sorted(r["sms_seen"] for r in ranks)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sms = all_sms()
    results = {"all_sms": sms, "one_client": one_client(sms), "four_ranks": four_ranks(sms)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
