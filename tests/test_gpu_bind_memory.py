"""GPU tier: --gpu-bind none on two GPUs, and --mem-limit auto with JAX, on the real MPS daemon.

--gpu-bind none needs two GPUs (the 2x H200 machine); on one GPU those tests skip.
"""

import json
import re
import subprocess
import sys

import pytest
from helpers import PATHS, gpu_job_argv

pytestmark = pytest.mark.gpu

#: A rank that picks its own device (local_rank, or local_rank % 2), computes on it, and records what it saw:
#: how many devices, the chosen device's UUID, and whether NVML lists this process as an MPS client there.
CHOOSER = (
    "import json, os, sys, time, cupy\n"
    "from mpsrun.mps.gpus import compute_processes\n"
    "local = int(os.environ['LOCAL_RANK'])\n"
    "device = local % int(sys.argv[1]) if len(sys.argv) > 1 else local\n"
    "cupy.cuda.Device(device).use()\n"
    "x = cupy.ones(1 << 20); x = (x * 2).sum(); cupy.cuda.Device().synchronize()\n"
    "import pynvml\npynvml.nvmlInit()\n"  # the device's UUID by its PCI bus id (CuPy 14 changed its properties' uuid)
    "gpu = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByPciBusId(cupy.cuda.Device(device).pci_bus_id))\n"
    "gpu = gpu.decode() if isinstance(gpu, bytes) else gpu\n"
    "time.sleep(0.5)\n"
    "seen = compute_processes(gpu)\n"
    "record = {'devices': cupy.cuda.runtime.getDeviceCount(), 'device': device, 'uuid': gpu,\n"
    "          'mps_client': seen.get(os.getpid()), 'sum': float(x)}\n"
    "open(os.path.join(os.environ['PROBE_DIR'], os.environ['RANK']), 'w').write(json.dumps(record))\n"
)


def gpu_count():
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("ranks", "modulo"), [(2, []), (4, ["2"])])
def test_ranks_that_choose_their_device(cupy_job, path, ranks, modulo, tmp_path, monkeypatch):
    """--gpu-bind none on 2 GPUs: 2 ranks on Device(local_rank), 4 on Device(local_rank % 2); every rank sees both
    GPUs and NVML lists it as an MPS client on the GPU it chose; -v proves every rank."""
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    argv = gpu_job_argv(path, ["-v", "--gpu-bind", "none"], [sys.executable, "-c", CHOOSER, *modulo], ranks=ranks)
    argv[argv.index("--gpus") + 1] = "0,1"
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert sorted(seen) == list(range(ranks))
    assert {r["devices"] for r in seen.values()} == {2}
    assert {r["device"] for r in seen.values()} == {0, 1}
    assert len({r["uuid"] for r in seen.values()}) == 2
    assert all(r["mps_client"] is True for r in seen.values()), seen
    assert re.search(rf"{ranks} of {ranks} ranks connected to MPS$", out.stderr, re.M), out.stderr[-3000:]


JAX = "import jax.numpy as jnp; x = jnp.ones((2048, 2048)); print(float((x @ x).sum()))"


@pytest.mark.parametrize("path", PATHS)
def test_jax_ranks_share_a_gpu_with_auto_memory(cupy_job, path):
    """4 unmodified JAX ranks (each preallocates 75% of what it sees free) run on one GPU with --mem-limit auto."""
    pytest.importorskip("jax")
    out = subprocess.run(gpu_job_argv(path, ["-v", "--mem-limit", "auto"], [sys.executable, "-c", JAX], ranks=4),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(str(float(2048 ** 3))) == 4, out.stdout
    assert re.search(r"4 of 4 ranks connected to MPS$", out.stderr, re.M), out.stderr[-3000:]
