"""One job contract on every path: the fault matrix, run under each way of starting ranks.

Paths: the local launcher, the mpiexec launcher (MPICH's Hydra from the mpich wheel),
``mpiexec -n 3 mpsrun --per-node`` and ``mpsrun --hosts localhost``. Each case must give the
same exit code and the same summary line on every path, and afterwards no rank, daemon,
server, session directory, lock file or temporary file may be left (the fake_gpu fixture
checks processes and session directories; this module checks $TMPDIR too).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import FAKECUDA, PATHS, PROGRAMS, daemon_session, fake, job_argv, mpsrun, settle, supervisors, wait_ready

pytestmark = pytest.mark.mpiexec

ABORT = PROGRAMS / "mpi_abort.py"


@pytest.fixture
def clean_tmp(monkeypatch, short_tmp):
    """A private $TMPDIR, checked empty afterwards: every file a job makes lives in its session directory."""
    tmp = short_tmp / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp
    assert sorted(p.name for p in tmp.iterdir()) == []


SEGV = "import os, signal, time\nif os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGSEGV)\ntime.sleep(30)"

#: case -> (options, program, exit code, summary)
CASES = {
    "rank-exits-7": ([], fake("--hold", "30", "--fail-rank", "1", "--exit", "7"), 7,
                     r"rank 1 \(pid \d+\) exited with code 7 first"),
    "rank-sigkilled": ([], fake("--hold", "30", "--kill-rank", "1"), 137,
                       r"rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\) first"),
    "rank-segfaults": ([], [sys.executable, "-c", SEGV], 139,
                       r"rank 1 \(pid \d+\) was killed by signal 11 \(SIGSEGV\) first"),
    "timeout": (["--timeout", "2"], fake("--hold", "60"), 124, r"timed out after 2 s"),
    "background-child-holds-stdout": ([], ["sh", "-c", "sleep 300 & exit 0"], 0, None),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_faults(fake_gpu, clean_tmp, path, case):
    """A rank that exits 7, is SIGKILLed, segfaults, hangs past --timeout or leaves a child holding stdout: the same
    exit code (128+N for signals) and the same summary on every path; the other ranks are stopped within --grace."""
    options, program, code, summary = CASES[case]
    started = time.monotonic()
    out = subprocess.run(job_argv(path, ["--grace", "1", *options], program), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == code, out.stderr
    if summary:
        assert re.search(summary, out.stderr), out.stderr
    assert time.monotonic() - started < 25, "the failure did not stop the job"
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_timeout_is_said_once(fake_gpu, path):
    """--timeout 5 with ranks that run on: exit 124 and one line of mpsrun's, ``timed out after 5 s`` (it was said
    twice: ``timeout: the job ran longer than 2 s; stopping it``, then the summary). The timeout outlasts start-up on
    a loaded machine (a timeout during start-up is said otherwise, and rightly)."""
    out = subprocess.run(job_argv(path, ["--timeout", "5", "--grace", "1"], fake("--hold", "60")), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 124, out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("mpsrun")] == [
        "mpsrun: timed out after 5 s"], out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signals_to_mpsrun(fake_gpu, clean_tmp, short_tmp, path, sig, code):
    """SIGINT, SIGTERM or SIGHUP to mpsrun (under --per-node: to every rank's mpsrun, as srun sends them) reach the
    ranks; the job exits 128+N and says it was stopped by that signal."""
    reports = short_tmp / "reports"
    reports.mkdir()
    job = subprocess.Popen(job_argv(path, ["--grace", "1"], fake("--hold", "60", "--report-dir", str(reports))),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_ready(reports, proc=job)
    for pid in supervisors(job, path):
        with contextlib.suppress(ProcessLookupError):  # (a rank the signals before it have ended, as srun's may)
            os.kill(pid, sig)
    _, err = job.communicate(timeout=60)
    assert job.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err, err
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_sigkill_to_mpsrun_leaves_nothing(fake_gpu, clean_tmp, short_tmp, path):
    """SIGKILL to mpsrun (under --per-node: to one rank's mpsrun; Hydra then kills the rest): the ranks, daemons and
    servers end and the session directory is removed without anyone running cleanup."""
    reports = short_tmp / "reports"
    reports.mkdir()
    job = subprocess.Popen(job_argv(path, ["--grace", "1"], fake("--hold", "60", "--report-dir", str(reports))),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(reports, proc=job)
    os.kill(supervisors(job, path)[0], signal.SIGKILL)
    assert job.wait(timeout=60) != 0
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_mpi_abort_in_one_rank(fake_gpu, clean_tmp, path):
    """MPI_Abort(5) in rank 1 of an mpi4py program ends the job with exit 5 on every path (Hydra kills every rank at
    once; mpsrun reports what it knows) and leaves nothing behind."""
    pytest.importorskip("mpi4py")
    out = subprocess.run(job_argv(path, ["--grace", "1"], [sys.executable, str(ABORT)]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 5, out.stderr
    if path != "per-node":  # there the launcher's own report is all there is
        assert re.search(r"rank 1 \(pid \d+\) exited with code 5 first|mpiexec exited with code 5", out.stderr)
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_tagged_partial_lines_are_never_merged(fake_gpu, clean_tmp, path):
    """--tag-output gives [rank N] on whole lines; a last line without a newline is finished, not run together."""
    code = "import os, sys; sys.stdout.write('full-' + os.environ['RANK'] + '\\npartial-' + os.environ['RANK'])"
    out = subprocess.run(job_argv(path, ["--tag-output"], [sys.executable, "-c", code]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(
        [f"[rank {r}] full-{r}" for r in range(3)] + [f"[rank {r}] partial-{r}" for r in range(3)])
    settle(fake_gpu)


def test_segfaulting_rank_gives_139(fake_gpu):
    """A rank killed by SIGSEGV makes mpsrun exit 139 and name the signal."""
    code = "import os, signal, sys; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGSEGV)"
    out = mpsrun("-np", 2, "--launcher", "local", sys.executable, "-c", code)
    assert out.returncode == 139
    assert "rank 1" in out.stderr and "SIGSEGV" in out.stderr


def test_fatal_gpu_fault_reports_the_torn_down_ranks(fake_gpu, short_tmp):
    """One rank's fatal GPU fault, once every rank is a client, tears down every client; mpsrun names the first rank
    to fail, says what the MPS log shows, and lists the ranks the server tore down."""
    out = mpsrun("-np", 3, "--launcher", "local", "--grace", "1",
                 *fake("--hold", "20", "--fault-rank", "1", "--report-dir", str(short_tmp)))
    assert out.returncode == 1
    assert "cudaErrorIllegalAddress" in out.stderr
    assert "a client hit a fatal GPU error" in out.stderr
    assert "rank(s) 0-2 were torn down by the MPS server after the fatal GPU fault" in out.stderr


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_twenty_instantly_failing_ranks(fake_gpu, path):
    """20 ranks that all fail at once: the first failure's code, one line, no traceback (descriptor reuse)."""
    out = subprocess.run(job_argv(path, [], ["sh", "-c", "exit 3"], ranks=20), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count(" first") == 1, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_file_that_cannot_be_executed_gives_126(fake_gpu, short_tmp, path):
    """A command that exists but cannot be executed gives 126 (as a shell does), not 127."""
    script = short_tmp / "noexec.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    out = subprocess.run(job_argv(path, [], [str(script)]), capture_output=True, text=True, timeout=120)
    assert out.returncode == 126, out.stderr
    assert "Permission denied" in out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("log", ["as it was", "with a 20 MB last line"])
@pytest.mark.parametrize("path", PATHS)
def test_the_daemon_dying_under_the_job_gives_3(fake_gpu, short_tmp, path, log):
    """The MPS daemon killed under running ranks: exit 3 on every path, the summary says the daemon died, quoting
    its log's last line cut to a line of ours. With a 20 MB last line (a rank can write the log) a node keeper's
    word was past what its link takes: --per-node exited 143 without a word, --hosts 137 blaming the keeper."""
    from mpsrun.runtime.output import LINE_MOST

    job = subprocess.Popen(job_argv(path, ["--grace", "1"], [sys.executable, str(FAKECUDA), "--hold", "60",
                                                             "--report-dir", str(short_tmp)]),
                           stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, proc=job)
    root = daemon_session(fake_gpu)
    if log != "as it was":
        with (root / "gpu0" / "log" / "control.log").open("a") as stream:
            stream.write("x" * 20_000_000)
    daemon = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3, err[:3000]
    assert "MPS control daemon of GPU 0 died under the job" in err and max(map(len, err.splitlines())) <= LINE_MOST
    settle(fake_gpu)


SLOW_CLEANUP = ("import os, signal, sys, time\n"
                "def stop(*_):\n"
                "    time.sleep(2); open(os.path.join(os.environ['MARK'], os.environ['RANK']), 'w').close(); sys.exit(0)\n"
                "signal.signal(signal.SIGINT, stop)\n"
                "open(os.path.join(os.environ['MARK'], 'ready' + os.environ['RANK']), 'w').close()\n"
                "time.sleep(60)\n")


@pytest.mark.parametrize("path", ["per-node", "mpiexec"])
def test_one_interrupt_per_rank_is_not_a_second_ctrl_c(fake_gpu, short_tmp, monkeypatch, path):
    """srun (and Hydra for its mpiexec) hands one SIGINT to every rank: that is one interrupt, so the ranks get
    their --grace to clean up instead of being killed at once."""
    monkeypatch.setenv("MARK", str(short_tmp))
    job = subprocess.Popen(job_argv(path, ["--grace", "10"], [sys.executable, "-c", SLOW_CLEANUP]),
                           stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, pattern="ready*", proc=job)
    if path == "per-node":
        targets = supervisors(job, path)
    else:
        targets = [p.pid for p in psutil.Process(job.pid).children() if "mpiexec" in p.name()]
    for pid in targets:
        os.kill(pid, signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert sorted(p.name for p in short_tmp.iterdir() if p.name.isdigit()) == ["0", "1", "2"], err
    assert "second interrupt" not in err
    settle(fake_gpu)
