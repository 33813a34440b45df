"""What the jobs of the two-host tests run, and how they check where their ranks ran: a reporting rank on each test
host's fake GPU (tests/testhosts.py), shared by tests/test_two_hosts.py and tests/test_slurm_two_hosts.py."""

from __future__ import annotations

import json
import sys

import testhosts
from helpers import FAKECUDA

#: A rank that says where it runs (one line, one write) and then becomes the fake CUDA program (its arguments).
REPORTING = (
    "import json, os, socket, sys\n"
    "keys = ('RANK', 'LOCAL_RANK', 'CUDA_VISIBLE_DEVICES', 'CUDA_MPS_PIPE_DIRECTORY', 'MPSRUN_FAKE_NVML', 'GREETING')\n"
    "line = json.dumps({'host': socket.gethostname(), **{k: os.environ.get(k) for k in keys}})\n"
    "sys.stdout.write(f'REPORT {line}\\n')\n"
    "sys.stdout.flush()\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)
BLOCK = {0: "h1", 1: "h1", 2: "h2", 3: "h2"}


def fake_program(*args: str) -> list[str]:
    """The reporting rank, as the fake CUDA program with ``args``."""
    return [sys.executable, "-c", REPORTING, str(FAKECUDA), *args]


def placed(stdout: str) -> dict[int, dict]:
    """Each rank's report (its REPORT line), by rank."""
    found = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("REPORT ")]
    return {int(report["RANK"]): report for report in found}


def summary(stderr: str) -> list[str]:
    """mpsrun's own lines."""
    return [line for line in stderr.splitlines() if line.startswith("mpsrun")]


def check_placement(hosts: dict[str, testhosts.TestHost], reports: dict[int, dict], where: dict[int, str]) -> None:
    """Every rank ran where ``where`` says, on that host's own fake GPU, through that host's own MPS daemon."""
    assert {rank: report["host"] for rank, report in reports.items()} == where, reports
    for report in reports.values():
        host = hosts[report["host"]]
        assert report["CUDA_VISIBLE_DEVICES"] == host.gpus[0]["uuid"], report
        assert report["CUDA_MPS_PIPE_DIRECTORY"].startswith(f"{testhosts.HOST_TMPDIR}/mpsrun-"), report
        assert report["MPSRUN_FAKE_NVML"] == testhosts.NVML_DIR, report  # the launcher's environment went across
    pipes = {report["host"]: report["CUDA_MPS_PIPE_DIRECTORY"] for report in reports.values()}
    assert len(set(pipes.values())) == len(pipes), pipes  # one session per host, each its own
