"""GPU tier: the fault matrix with the real MPS daemon and CuPy ranks.

For each fault: the documented exit code, a summary naming the cause, and afterwards no
process of the job, no MPS daemon or server of the job and no session directory.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.gpu

BUSY = (
    "import os, sys, time, cupy\n"
    "x = cupy.ones(1 << 16, dtype=cupy.float32)\n"
    "rank = int(os.environ['RANK'])\n"
    "mode = sys.argv[1]\n"
    "os.write(1, b'ready\\n')\n"  # one write: print() makes two when unbuffered (PYTHONUNBUFFERED), and three
    # ranks' "ready" and "\n" interleaved into "readyready", so the test waited for a third line in vain
    "if mode == 'exit' and rank == 1: time.sleep(1); sys.exit(7)\n"
    "if mode == 'kill' and rank == 1: time.sleep(1); os.kill(os.getpid(), 9)\n"
    "if mode == 'segv' and rank == 1: time.sleep(1); os.kill(os.getpid(), 11)\n"
    "if mode == 'fault' and rank == 1:\n"
    "    time.sleep(1)\n"
    "    k = cupy.RawKernel(r'extern \"C\" __global__ void bad(int* p) { p[threadIdx.x] = 1; }', 'bad')\n"
    "    k((1,), (32,), (cupy.int64(16),)); cupy.cuda.Device().synchronize()\n"
    "end = time.monotonic() + 60\n"
    "while time.monotonic() < end:\n"
    "    x = x * 1.0000001\n"
    "    cupy.cuda.Device().synchronize()\n"
)


@pytest.fixture
def job(tmp_path):
    """Runs mpsrun on CuPy ranks with a private MPSRUN_TMPDIR and a tag; checks nothing is left afterwards."""
    tag = uuid.uuid4().hex
    base = Path(tempfile.mkdtemp(prefix="gf", dir="/tmp"))  # short: MPS socket paths are limited
    env = {**os.environ, "MPSRUN_TMPDIR": str(base), "MPSRUN_TEST_TAG": tag}
    script = tmp_path / "busy.py"
    script.write_text(BUSY)

    def start(mode, *options):
        return subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "3", "--launcher", "local", "--mps", "on",
                                 "--grace", "3", *options, sys.executable, str(script), mode],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    start.base = base
    start.env = env
    yield start
    deadline = time.monotonic() + 15
    while True:
        left = []
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                environ = proc.environ()
            except psutil.Error:
                continue
            if environ.get("MPSRUN_TEST_TAG") == tag or str(base) in environ.get("CUDA_MPS_PIPE_DIRECTORY", ""):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append((proc.pid, proc.info["name"]))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
    sessions = list((base / f"mpsrun-{os.getuid()}").glob("s*")) if (base / f"mpsrun-{os.getuid()}").exists() else []
    assert sessions == [], f"session directories left: {sessions}"
    shutil.rmtree(base, ignore_errors=True)


def wait_ready_lines(proc, count=3, timeout=120):
    deadline = time.monotonic() + timeout
    seen = 0
    while seen < count:
        assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
        if proc.stdout.readline().strip() == "ready":
            seen += 1


@pytest.mark.parametrize(("mode", "code", "words"), [("exit", 7, "exited with code 7 first"),
                                                     ("kill", 137, "signal 9 (SIGKILL)"),
                                                     ("segv", 139, "signal 11 (SIGSEGV)")])
def test_a_rank_fails(job, mode, code, words):
    """A rank exits non-zero / is SIGKILLed / segfaults: its code (128+N for signals), the others stopped."""
    proc = job(mode)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err
    assert "rank 1 (pid" in err and words in err


def test_cuda_illegal_address_under_mps(job):
    """One rank's illegal memory access: MPS tears down the clients; mpsrun fails and says what happened."""
    proc = job("fault")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "illegal memory access" in err.lower() or "cudaErrorIllegalAddress" in err
    assert "a client hit a fatal GPU error" in err
    print(err[-3000:])


def test_timeout(job):
    """A hanging job is ended by --timeout with exit 124."""
    proc = job("hang", "--timeout", "8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 124 and "timeout" in err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_mpsrun(job, sig, code):
    """SIGINT / SIGTERM (a batch system's time limit) to mpsrun: forwarded, everything stopped, 128+N."""
    proc = job("hang")
    wait_ready_lines(proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code and f"received {signal.Signals(sig).name}" in err


def test_mpsrun_sigkilled_leaves_nothing(job):
    """mpsrun SIGKILLed: the daemon dies with it, the rank supervisors stop the ranks, and the session's reaper
    removes the directory: the fixture finds nothing left, and no cleanup is needed."""
    proc = job("hang")
    wait_ready_lines(proc)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while list((job.base / f"mpsrun-{os.getuid()}").glob("s*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = subprocess.run([sys.executable, "-m", "mpsrun", "status", "--json"], env=job.env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_daemon_killed_under_the_job(job):
    """The MPS daemon killed under running ranks: the job fails and the summary says the daemon stopped."""
    proc = job("hang")
    wait_ready_lines(proc)
    [info] = (job.base / f"mpsrun-{os.getuid()}").glob("s*/session.json")
    daemon = json.loads(Path(info).read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "MPS control daemon" in err, err[-2000:]
