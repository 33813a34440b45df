"""The mpiexec launcher's head start (mpsrun.headstart): mpiexec starts before the daemons answer, no rank runs
its command before they do, and a job that cannot start after all leaves nothing (mpiexec's processes, the
session directory, the socket) and says one line.

An mpiexec wrapper notes when it is started (never for ``--version``) and runs MPICH's mpiexec, so the tests can
tell that mpiexec really was running while the daemon had not answered.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_contract import job_argv, mpiexec, settle
from test_hostile_paths import ours

pytestmark = pytest.mark.mpiexec

WRAPPER = """\
import os, sys
if sys.argv[1:] != ["--version"]:
    with open({marker!r}, "a") as out:
        out.write(str(os.getpid()) + "\\n")
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


@pytest.fixture
def noted_mpiexec(short_tmp):
    """An mpiexec that writes its pid to a file when started for a job; (its path, the file)."""
    marker = short_tmp / "started"
    path = short_tmp / "mpiexec"
    path.write_text(f"#!{sys.executable}\n" + WRAPPER.format(marker=str(marker), real=mpiexec()))
    path.chmod(0o755)
    return path, marker


def job(noted, *options, program=("true",)):
    argv = job_argv("mpiexec", list(options), list(program), ranks=2)
    argv[argv.index("--mpiexec") + 1] = str(noted[0])
    return argv


def test_mpiexec_runs_while_the_daemon_has_not_answered(fake_gpu, noted_mpiexec):
    """A daemon that never answers: mpiexec was started all the same (the head start), and the job's --timeout
    ends it with one line and its exit code; mpiexec's processes and the session directory are gone."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    out = subprocess.run(job(noted_mpiexec, "--timeout", "3", "--mps", "on"), capture_output=True, text=True,
                         timeout=120)
    assert noted_mpiexec[1].exists(), "mpiexec was not started before the daemon answered"
    assert out.returncode == 124 and len(ours(out.stderr)) == 1, out.stderr
    assert "timed out" in out.stderr and out.stdout == ""
    settle(fake_gpu)


def test_no_rank_runs_before_the_daemon_answers(fake_gpu, noted_mpiexec, short_tmp):
    """The ranks wait for their welcome: with the daemon slow to answer, no rank's command has run while mpiexec
    was already up; once it answers, every rank runs as an MPS client of it."""
    fake_gpu.daemon_env(FAKE_MPS_START_DELAY="3")
    probe = "import os, pathlib, time; pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(" \
            "f\"{time.time()} {os.environ['CUDA_MPS_PIPE_DIRECTORY']}\")"
    env = {**os.environ, "OUT": str(short_tmp)}
    start = time.time()
    proc = subprocess.run(job(noted_mpiexec, "--mps", "on", program=(sys.executable, "-c", probe)), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    mpiexec_started = noted_mpiexec[1].stat().st_mtime
    ran = [(short_tmp / str(rank)).read_text().split() for rank in range(2)]
    assert mpiexec_started < start + 3 <= min(float(when) for when, _ in ran), "a rank ran before the daemon answered"
    assert all(pipe.endswith("/gpu0/pipe") for _, pipe in ran)
    settle(fake_gpu)


@pytest.mark.parametrize("fault", ["unknown-gpu", "daemon-fails", "interrupt"])
def test_a_job_that_cannot_start_leaves_nothing(fake_gpu, noted_mpiexec, fault):
    """After mpiexec's head start: an unknown GPU (2), a daemon that fails to start (3) or a SIGINT while the
    daemon does not answer (130) each give one line and that exit code, and leave no process and no directory."""
    options = ["--mps", "on"] + (["--gpus", "7"] if fault == "unknown-gpu" else [])
    fake_gpu.daemon_env(**({"FAKE_MPS_START_FAIL": "1"} if fault == "daemon-fails" else
                           {"FAKE_MPS_NO_ANSWER": "1"} if fault == "interrupt" else {}))
    proc = subprocess.Popen(job(noted_mpiexec, *options), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if fault == "interrupt":
        deadline = time.monotonic() + 60
        while not noted_mpiexec[1].exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    expected = {"unknown-gpu": 2, "daemon-fails": 3, "interrupt": 130}[fault]
    assert proc.returncode == expected and len(ours(err)) == 1 and out == "", (proc.returncode, err)
    settle(fake_gpu)  # mpiexec may have been killed before it could note its start: no check of the note here
