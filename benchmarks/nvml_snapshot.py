"""While an mpsrun job runs on every GPU, record what NVML and each MPS daemon say (diagnostics).

    python benchmarks/nvml_snapshot.py OUTDIR NRANKS
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pynvml

out, n = Path(sys.argv[1]), int(sys.argv[2])
probe = Path(__file__).resolve().parent.parent / "tests" / "programs" / "gpu_probe.py"
argv = [sys.executable, "-m", "mpsrun", "-v", "--keep-logs", "--mps", "auto", "-np", str(n), "--gpus", "all",
        "--launcher", "local", "--tag-output", sys.executable, str(probe), "--seconds", "12"]
job_out, job_err = open(out / "job.out", "w"), open(out / "job.err", "w")  # noqa: SIM115 - live until the job ends
job = subprocess.Popen(argv, stdout=job_out, stderr=job_err)
snapshots = []
time.sleep(8)
pynvml.nvmlInit()
for _ in range(3):
    snap = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        snap[i] = {
            "compute": sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
            "mps": sorted(p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)),
        }
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    snapshots.append({"nvml": snap, "ps": ps})
    time.sleep(1)
job.wait()
job_out.close()
job_err.close()
for d in Path("/tmp/mpsrun-0").glob("s*/gpu*/log/control.log"):
    (out / f"{d.parts[-4]}-{d.parts[-3]}.log").write_text(d.read_text())
(out / "snapshots.json").write_text(json.dumps(snapshots, indent=1))
print("exit", job.returncode)
