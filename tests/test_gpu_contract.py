"""GPU tier: the one job contract on every path, with the real MPS daemon, CuPy ranks and the machine's mpiexec.

The paths of tests/test_contract.py (local, mpiexec, per-node under mpiexec, --hosts localhost),
here with Open MPI on the GPU machine. Each case must give the same exit code on every path,
and leave no rank, MPS daemon or server of the job and no session directory.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import PATHS, TESTS, gpu_job_argv, supervisors, wait_ready

pytestmark = pytest.mark.gpu

PROBE = TESTS / "programs" / "gpu_probe.py"
ABORT = TESTS / "programs" / "mpi_abort.py"



@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("mode", "code", "words"), [("exit", 7, "exited with code 7 first"),
                                                     ("kill", 137, "signal 9 (SIGKILL) first"),
                                                     ("segv", 139, "signal 11 (SIGSEGV) first")])
def test_a_cupy_rank_fails(cupy_job, path, mode, code, words):
    """A CuPy rank exits 7 / is SIGKILLed / segfaults: the same code on every path, the others stopped."""
    out = subprocess.run(gpu_job_argv(path, ["--grace", "2"], [sys.executable, str(cupy_job["script"]), mode]),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == code, out.stderr[-3000:]
    assert "rank 1 (pid" in out.stderr and words in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("path", PATHS)
def test_timeout(cupy_job, path):
    """--timeout ends hanging CuPy ranks with exit 124 on every path."""
    out = subprocess.run(gpu_job_argv(path, ["--grace", "2", "--timeout", "15"],
                                  [sys.executable, str(cupy_job["script"]), "hang"]),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 124 and "timed out after 15 s" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGKILL, None)])
def test_signal_to_mpsrun(cupy_job, path, sig, code):
    """SIGTERM to mpsrun (under --per-node: to each rank's mpsrun) gives 143; SIGKILL (to one) leaves nothing."""
    proc = subprocess.Popen(gpu_job_argv(path, ["--grace", "2"], [sys.executable, str(cupy_job["script"]), "hang"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_ready(cupy_job["ready"], timeout=120, proc=proc, pattern="*")
    targets = supervisors(proc, path)
    for pid in targets if sig != signal.SIGKILL else targets[:1]:
        os.kill(pid, sig)
    _, err = proc.communicate(timeout=180)
    if code is not None:
        assert proc.returncode == code and "stopped by SIGTERM" in err, err[-3000:]
    else:
        assert proc.returncode != 0


@pytest.mark.parametrize("path", PATHS)
def test_mpi_abort(cupy_job, path):
    """MPI_Abort(5) in rank 1 of an mpi4py program: exit 5 on every path, nothing left."""
    out = subprocess.run(gpu_job_argv(path, ["--grace", "2"], [sys.executable, str(ABORT)]), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 5, out.stderr[-3000:]


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_is_a_verified_mps_client(cupy_job, path, tmp_path, monkeypatch):
    """4 CuPy ranks on each path: every one verified as a client of the job's (or node's) MPS server, 25% each."""
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    out = subprocess.run(gpu_job_argv(path, ["-v", "--thread-percentage", "auto"], [sys.executable, str(PROBE),
                                                                              "--seconds", "4"], ranks=4),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"4 of 4 ranks connected to MPS", out.stderr), out.stderr[-3000:]
    probes = [p for p in tmp_path.glob("*.json")]
    assert len(probes) == 4


SHORT = "import cupy; cupy.ones(8).sum(); cupy.cuda.Device().synchronize()"
SM_PROBE = (
    "import json, os, cupy\n"
    "sms = cupy.cuda.Device().attributes['MultiProcessorCount']\n"
    "open(os.path.join(os.environ['PROBE_DIR'], os.environ['RANK']), 'w').write(json.dumps(sms))\n"
)


@pytest.mark.parametrize("path", PATHS)
def test_ranks_that_live_well_under_a_second_are_proven(cupy_job, path):
    """4 CuPy ranks that each use the GPU for a few ms: every one proven an MPS client by the daemon's log."""
    out = subprocess.run(gpu_job_argv(path, ["-v"], [sys.executable, "-c", SHORT], ranks=4), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"4 of 4 ranks connected to MPS$", out.stderr, re.M), out.stderr[-3000:]


def _all_sms():
    """The SM count a process sees without MPS (the test process is no part of the job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    reply = subprocess.run([sys.executable, "-c", "import cupy; print(cupy.cuda.Device().attributes"
                            "['MultiProcessorCount'])"], capture_output=True, text=True, env=env, check=True)
    return int(reply.stdout)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("option", "ranks", "percent"), [("50", 2, [50, 50]), ("25,75", 2, [25, 75]),
                                                          ("auto", 4, [25, 25, 25, 25]), ("100", 1, [100])])
def test_each_rank_sees_its_share_of_the_sms(cupy_job, path, option, ranks, percent, tmp_path, monkeypatch):
    """The active-thread percentage caps the SMs a rank's CUDA sees: with a value, a per-rank list and auto,
    on every path, each rank's MultiProcessorCount is its share of all SMs (MPS rounds to whole TPCs)."""
    total = _all_sms()
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    out = subprocess.run(gpu_job_argv(path, ["--thread-percentage", option], [sys.executable, "-c", SM_PROBE],
                                  ranks=ranks), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert sorted(seen) == list(range(ranks)), out.stderr[-3000:]
    for rank, share in enumerate(percent):
        assert abs(seen[rank] - total * share / 100) <= 4, (rank, share, seen, total)
