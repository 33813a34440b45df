"""The mpiexec launcher's head start: mpiexec starts before the MPS session, whose set-up may still fail.

mpiexec takes 0.3 s to start its ranks (Open MPI on the H100 machine), so the launcher starts it once the
job's directory and control socket exist, and reads the GPUs and starts the daemons meanwhile. Every
promise of a job that cannot start must still hold then: one line, its exit code, no rank run, no word
from the rank supervisors mpiexec did start (nor a banner from mpiexec), and nothing left behind.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_contract import mpiexec, settle

pytestmark = pytest.mark.mpiexec

RAN = "import os, pathlib; pathlib.Path(os.environ['RAN_MARKER']).touch()"


def recording_mpiexec(directory: Path) -> Path:
    """A wrapper of the real mpiexec that leaves a file when it starts, then runs it."""
    wrapper = directory / "mpiexec"
    marker = directory / "mpiexec-started"
    wrapper.write_text(f"#!{sys.executable}\nimport os, pathlib, sys\n"
                       f"if sys.argv[1:2] != ['--version']:\n    pathlib.Path({str(marker)!r}).touch()\n"
                       f"os.execv({mpiexec()!r}, [{mpiexec()!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    return wrapper


def job(wrapper: Path, options: list[str], short_tmp: Path) -> list[str]:
    return [sys.executable, "-m", "mpsrun", "-np", "3", "--launcher", "mpiexec", "--mpiexec", str(wrapper), *options,
            sys.executable, "-c", RAN]


@pytest.mark.parametrize(("case", "options", "code", "line"), [
    ("daemon fails", [], 3, "mpsrun: error: MPS control daemon exited with code 1 while starting"),
    ("no such GPU", ["--gpus", "7"], 2, "mpsrun: error: GPU 7 is not visible"),
])
def test_a_job_that_cannot_start_after_mpiexec_did_says_one_line(fake_gpu, short_tmp, monkeypatch, case, options,
                                                                 code, line):
    """mpiexec has started (the wrapper says so) when the session's set-up fails: its rank supervisors are
    refused without a word and with exit 0 (so mpiexec prints no banner), no rank runs, the job's error is the
    one line on stderr with its usual exit code, and nothing is left (the fixture checks processes and
    directories)."""
    fake_gpu.daemon_env(FAKE_MPS_START_FAIL="1")
    monkeypatch.setenv("RAN_MARKER", str(short_tmp / "ran"))
    wrapper = recording_mpiexec(short_tmp)
    out = subprocess.run(job(wrapper, options, short_tmp), capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert (short_tmp / "mpiexec-started").exists(), "mpiexec was not started ahead of the session"
    assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and not (short_tmp / "ran").exists()
    settle(fake_gpu)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_daemons_start_ends_mpiexec_quietly(fake_gpu, short_tmp, monkeypatch, sig):
    """A stopping signal once mpiexec runs but before any daemon answers: the job says it was interrupted, in one
    line, exits 128+N, and mpiexec and its rank supervisors end without a word; no rank runs, nothing is left."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    monkeypatch.setenv("RAN_MARKER", str(short_tmp / "ran"))
    wrapper = recording_mpiexec(short_tmp)
    proc = subprocess.Popen(job(wrapper, [], short_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (short_tmp / "mpiexec-started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "mpiexec did not start before the daemons"
        time.sleep(0.01)
    time.sleep(0.5)  # mpiexec's supervisors connect meanwhile, and wait for their welcome
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert err == f"mpsrun: error: interrupted by {signal.Signals(sig).name}\n", err
    assert out == "" and not (short_tmp / "ran").exists()
    settle(fake_gpu)


def test_mpsrun_killed_while_the_daemons_start_leaves_nothing(fake_gpu, short_tmp, monkeypatch):
    """SIGKILL of mpsrun once mpiexec runs and the session's directory exists: the reaper removes the directory
    and stops the daemon, mpiexec ends with its owner (parent-death signal), its supervisors with it; no rank
    runs (the fixture checks for leftover processes and directories)."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    monkeypatch.setenv("RAN_MARKER", str(short_tmp / "ran"))
    wrapper = recording_mpiexec(short_tmp)
    proc = subprocess.Popen(job(wrapper, [], short_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (list(fake_gpu.tmpdir.rglob("control.log")) and (short_tmp / "mpiexec-started").exists()):
        assert time.monotonic() < deadline, "the daemon or mpiexec did not start"
        time.sleep(0.01)
    time.sleep(0.3)  # mpiexec's supervisors connect meanwhile
    proc.kill()
    proc.communicate(timeout=30)
    settle(fake_gpu)
    assert not (short_tmp / "ran").exists()
    assert not fake_gpu.session_dirs()


def test_the_ranks_run_only_once_the_daemons_answer(fake_gpu, short_tmp, monkeypatch):
    """With mpiexec started first, a rank still starts only after its GPU's daemon answers (a CUDA client that
    cannot reach the daemon silently runs without MPS): each rank finds its daemon's socket in its pipe
    directory when it starts."""
    monkeypatch.setenv("RAN_MARKER", str(short_tmp / "ran"))
    wrapper = recording_mpiexec(short_tmp)
    check = ("import os, sys; pipe = os.environ['CUDA_MPS_PIPE_DIRECTORY']; "
             "sys.exit(0 if 'control' in os.listdir(pipe) else 9)")
    out = subprocess.run([*job(wrapper, ["--mps", "on"], short_tmp)[:-3], sys.executable, "-c", check],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (short_tmp / "mpiexec-started").exists()
    settle(fake_gpu)

