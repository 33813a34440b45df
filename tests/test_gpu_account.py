"""GPU tier for issue 38: each rank's account and ``mpsrun top`` with the real NVML and MPS daemon, CuPy ranks."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MPSRUN, PATHS, gpu_job_argv, wait_for

from mpsrun.agent.account import report_path
from mpsrun.mps import gpus

pytestmark = pytest.mark.gpu

#: A CuPy rank that holds MiB of device memory (its item of argv[1]), says its pid, and waits for argv[2]/go.
HOLDS = """
import os, sys, time, cupy
held = cupy.zeros(int(sys.argv[1].split(",")[int(os.environ["RANK"])]) << 20, dtype=cupy.uint8)
cupy.cuda.Device().synchronize()
path = os.path.join(sys.argv[2], os.environ["RANK"])
open(path + ".tmp", "w").write(str(os.getpid())); os.replace(path + ".tmp", path)
deadline = time.monotonic() + 90
while not os.path.exists(os.path.join(sys.argv[2], "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
HELD = (512, 1024, 1536, 2048)  # the 0.5, 1, 1.5 and 2 GiB


def _listed(folder: Path) -> dict[int, int]:
    """NVML's listing of each rank's device memory (MiB), by rank, once all of them hold their memory."""
    pids = wait_for(lambda: {int(p.name): int(p.read_text()) for p in folder.iterdir() if p.name.isdigit()}
                    if len([p for p in folder.iterdir() if p.name.isdigit()]) == len(HELD) else None, timeout=120,
                    what="the CuPy ranks holding their memory")
    memory = gpus.process_memory(gpus.list_gpus()[0].uuid)
    return {rank: memory[pid] >> 20 for rank, pid in pids.items()}


@pytest.mark.parametrize("path", PATHS)
def test_each_ranks_account_and_top_say_what_nvml_lists(path, tmp_path):
    """Four CuPy ranks holding 0.5, 1, 1.5 and 2 GiB on GPU 0: while they run, `mpsrun top --json` and `--once` show
    each with the device memory NVML lists for its process (within 2 MiB), as an MPS client on GPU 0; at the end the
    report's peaks are the same figures, each rank proven an MPS client, with its wall and CPU time."""
    report = tmp_path / "job.json"
    argv = gpu_job_argv(path, ["-v", "--report", str(report)],
                        [sys.executable, "-c", HOLDS, ",".join(map(str, HELD)), str(tmp_path)], ranks=len(HELD))
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listed = _listed(tmp_path)
        time.sleep(1.5)  # the job's controller samples every 0.5 s
        top = subprocess.run([*MPSRUN, "top", "--json"], capture_output=True, text=True, timeout=60)
        once = subprocess.run([*MPSRUN, "top", "--once"], capture_output=True, text=True, timeout=60)
    finally:
        (tmp_path / "go").touch()
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert top.returncode == 0, top.stderr
    rows = {r["rank"]: r for r in json.loads(top.stdout)["ranks"] if r["state"] != "remote"}
    assert sorted(rows) == list(range(len(HELD))), rows
    table = {int(cells[1]): int(cells[6]) for cells in map(str.split, once.stdout.splitlines())
             if len(cells) > 6 and cells[0] == rows[0]["job"] and cells[1].isdigit()}
    assert {rank: abs(table[rank] - listed[rank]) <= 2 for rank in listed} == dict.fromkeys(listed, True), (table, listed)
    for rank, held in enumerate(HELD):
        assert listed[rank] >= held and abs(rows[rank]["memory"] - listed[rank]) <= 2, (rows[rank], listed)
        assert (rows[rank]["gpu"], rows[rank]["mps"]) == (0, True), rows[rank]
    written = json.loads(Path(report_path(str(report), per_host=path == "per-node")).read_text())
    for account, rank in zip(written["ranks"], range(len(HELD)), strict=True):
        assert abs(account["memory_peak"] - listed[rank]) <= 2, (account, listed)
        assert account["mps"] is True and account["gpu"] == 0 and account["wall"] > 1 and account["cpu"] > 0
    print(f"{path}: NVML listed {listed}; report {[a['memory_peak'] for a in written['ranks']]}", file=sys.stderr)
