"""Does CUDA_MPS_ACTIVE_THREAD_PERCENTAGE limit a client's kernel here? (GPU machine)

    python benchmarks/atp_check.py

Times one GPU-filling kernel in a fresh client under several settings: the client's
variable, the daemon's default, and both, so the cap's effect is measured, not assumed.
"""

import json
import os
import subprocess
import sys

from mpsrun import mps_session

CLIENT = r"""
import time, cupy
k = cupy.RawKernel(r'''
extern "C" __global__ void spin(float* out, int iters) {
    float x = threadIdx.x * 1e-6f;
    for (int i = 0; i < iters; ++i) x = fmaf(x, 0.9999999f, 1e-7f);
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}''', 'spin')
sms = cupy.cuda.Device().attributes['MultiProcessorCount']
out = cupy.empty(sms * 8 * 256, dtype=cupy.float32)
k((sms * 8,), (256,), (out, cupy.int32(1000))); cupy.cuda.Device().synchronize()
t = time.perf_counter(); k((sms * 8,), (256,), (out, cupy.int32(2_000_000))); cupy.cuda.Device().synchronize()
print((time.perf_counter() - t) * 1000)
"""


def client_ms(env):
    out = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


results = {}
base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
results["no_mps"] = client_ms(base)
if sys.argv[1:] == ["hand"]:
    # MPS started by hand, as NVIDIA's guide does it: does the cap work there?
    import tempfile
    import time

    for flag in ("-d", "-f"):
        tmp = tempfile.mkdtemp(prefix="atp", dir="/tmp")
        env = {**base, "CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp}
        daemon = subprocess.Popen(["nvidia-cuda-mps-control", flag], env=env, stdout=subprocess.DEVNULL)
        while subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", env=env,
                             capture_output=True, text=True).returncode != 0:
            time.sleep(0.01)
        for pct in (None, 25):
            extra = {} if pct is None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}
            results[f"hand {flag} client={pct}"] = client_ms({**env, **extra})
        for cmd in ("get_server_list", "quit"):
            results[f"hand {flag} {cmd}"] = subprocess.run(["nvidia-cuda-mps-control"], input=cmd + "\n", env=env,
                                                           capture_output=True, text=True).stdout.strip()
        daemon.wait(timeout=30)
    print(json.dumps(results, indent=1))
    raise SystemExit(0)
for default in (None, 25):
    with mps_session(gpu=0, mps="on", thread_percentage=default, export=False) as session:
        env = {**base, **session.env()}
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        results[f"daemon_default={default} client=unset"] = client_ms(env)
        for pct in (25, 50):
            results[f"daemon_default={default} client={pct}"] = client_ms(
                {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)})
        server = session.daemons[0].server_list()[0]
        results[f"daemon_default={default} server_atp"] = session.daemons[0].command(
            f"get_active_thread_percentage {server}")
print(json.dumps(results, indent=1))
