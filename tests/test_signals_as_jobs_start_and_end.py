"""Signals that come while a job starts or ends: acted on once the block they came in ends, said once, never lost,
and not fatal where they mean nothing (SIGUSR1).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import (
    PATHS,
    control_logs,
    fake,
    job_argv,
    per_node_ranks,
    settle,
    supervisors,
    wait_for,
)

pytestmark = pytest.mark.mpiexec


def test_a_signal_inside_an_uninterrupted_block_is_acted_on_as_it_ends():
    """``uninterrupted()``: a stopping signal is raised as InterruptionError once the block has ended (a
    process started there is on record by then), never inside it; outside a job's handlers, and during a
    teardown that defers signals, the block changes nothing."""
    from mpsrun.runtime.interrupts import InterruptionError, Interrupts, uninterrupted

    steps = []
    with Interrupts() as interrupts:
        with pytest.raises(InterruptionError) as caught, uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("after the signal, inside the block")
        assert caught.value.exit_code == 143 and interrupts.received == [signal.SIGTERM]
    assert steps == ["after the signal, inside the block"]
    with Interrupts() as interrupts, interrupts.deferred(), uninterrupted():  # a teardown: only remembered
        os.kill(os.getpid(), signal.SIGHUP)
    assert interrupts.received == [signal.SIGHUP]
    with uninterrupted():  # no job's handlers: nothing to defer
        steps.append("plain")
    assert steps[-1] == "plain"


def test_a_signal_after_the_teardown_and_before_the_handlers_go_is_only_remembered():
    """Once a job's teardown begins (``defer_to_the_end``), a stopping signal up to the end of the handlers' block
    (NVML's shutdown comes there) is only remembered, for the job's end to say: it raised there, and a Ctrl-C as a
    job ended was 'mpsrun: error: interrupted by SIGINT' instead of 'interrupted by SIGINT while ending the job'
    (seen on a loaded machine)."""
    from mpsrun.runtime.interrupts import Interrupts

    with Interrupts() as interrupts:
        interrupts.defer_to_the_end()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
    assert interrupts.received == [signal.SIGINT, signal.SIGTERM]


@pytest.mark.parametrize(("path", "sig"), [("local", signal.SIGTERM), ("mpiexec", signal.SIGTERM),
                                         ("hosts", signal.SIGHUP)])
@pytest.mark.slow
def test_a_signal_during_the_teardown_is_said(fake_gpu, short_tmp, path, sig):
    """A SIGTERM or SIGHUP to mpsrun once the ranks have ended, while a daemon will not quit: teardown finishes
    within its deadlines, the job exits 128+N and says so in one line, besides the line about the quit (it used to
    exit in silence; --hosts, whose node keepers tear down while its loop runs, took it for a signal to a running
    job: 'received SIGHUP; stopping the ranks', a rank's 'interrupted by SIGTERM', 'stopped by SIGHUP'). The signal
    is sent once both ranks have run and a quit is logged after that (on a loaded machine a quit seen before the
    ranks ran made the signal one to a job still starting)."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    argv = job_argv(path, [], fake("--hold", "0.2", "--report-dir", str(short_tmp)), ranks=2)
    job = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2, what="the ranks did not start", proc=job)
    wait_for(lambda: any("Cmd:quit" in log for log in control_logs(fake_gpu)), what="the ranks did not end",
             proc=job)  # the teardown's quit hangs for its 10 s
    job.send_signal(sig)
    _, err = job.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 128 + sig, err
    assert f"mpsrun: interrupted by {sig.name} while ending the job" in lines and len(lines) == 2, err
    settle(fake_gpu)


@pytest.mark.slow
def test_a_signal_to_every_per_node_rank_during_the_teardown_is_said_once(fake_gpu, short_tmp):
    """SIGTERM to every rank's mpsrun under --per-node (as srun gives it) once the ranks have ended, while a daemon
    will not quit: the job exits 143 with one line for it, besides the quit's. Ranks that wait for their node's
    others (so that they leave MPICH's Hydra together) said it too, a line each."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    job = subprocess.Popen(job_argv("per-node", [], fake("--hold", "0.2", "--report-dir", str(short_tmp))),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 3, what="the ranks did not start", proc=job)
    wait_for(lambda: any("Cmd:quit" in log for log in control_logs(fake_gpu)), what="the ranks did not end",
             proc=job)  # the teardown's quit hangs for its 10 s
    for rank in per_node_ranks(job):
        with contextlib.suppress(psutil.NoSuchProcess):  # (a rank the signals before it have ended)
            rank.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 143 and len(lines) == 2, err
    assert "interrupted by SIGTERM while the job ended" in lines[1], err
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "mpiexec", "hosts"])
@pytest.mark.slow
def test_a_signal_as_the_ranks_are_done_is_said_as_one_while_ending(fake_gpu, path):
    """A SIGTERM as soon as ``-v`` says the ranks are done (the loop is over, the daemons' quit has begun, the report
    is being made) is one while the job ends: exit 143 and its one line. It was 'mpsrun: error: interrupted by
    SIGTERM', or a logging traceback when it came inside a ``-v`` line (a helper saw one or the other in most of 17
    tries; the suite, now and then)."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    job = subprocess.Popen(job_argv(path, ["-v"], fake("--hold", "0.2"), ranks=2), stderr=subprocess.PIPE, text=True)
    seen = []
    for line in job.stderr:
        seen.append(line)
        if "ranks done after" in line:
            job.send_signal(signal.SIGTERM)
            break
    err = "".join(seen) + job.stderr.read()
    assert job.wait(timeout=60) == 143, err
    assert "mpsrun: interrupted by SIGTERM while ending the job" in err, err
    assert "error: interrupted" not in err and "Logging error" not in err, err
    settle(fake_gpu)


@pytest.mark.parametrize(("code", "expected", "said"), [(0, 143, True), (7, 7, False)])
def test_a_signal_after_the_jobs_own_handling_is_not_lost(code, expected, said):
    """A SIGTERM in the last moment, once the job's handlers have given the signals back and before mpsrun exits:
    a job that succeeded exits 143 and says so, as for a signal during its teardown; a failed job keeps its code
    (a hostile pass saw exit 0 in silence, 3 of 39 signals sent as teardown ended)."""
    program = ("import os, signal\nimport mpsrun._entry as entry\nimport mpsrun.cli\n"
               f"def finished(pending):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return {code}\n"
               "mpsrun.cli.main = finished\nentry.main()\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == expected, out.stderr
    assert (out.stderr == "mpsrun: interrupted by SIGTERM while ending the job\n") if said else not out.stderr, out.stderr


def test_a_parent_gone_before_the_death_signal_was_asked_for_still_ends_the_child():
    """A child whose parent died between the fork and its PR_SET_PDEATHSIG request would never get the signal (a
    SIGKILLed mpsrun left a live daemon so, 2 in 25 tries): given the pid that forked it, it ends itself at once."""
    from mpsrun.runtime.processes import set_parent_death_signal

    pid = os.fork()
    if pid == 0:  # our "parent" is not the pid the caller read before the fork: it counts as gone
        # As mpsrun's forked supervisor has it: SIGTERM at its default and not blocked, whatever an earlier test
        # of this worker left in the process (a handler, a mask) and the fork copied.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        set_parent_death_signal(signal.SIGTERM, parent=os.getppid() + 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    pid = os.fork()
    if pid == 0:  # the real parent: no signal
        set_parent_death_signal(signal.SIGTERM, parent=os.getppid())
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_sigkill_as_the_session_directory_appears_leaves_nothing(fake_gpu, launcher):
    """mpsrun SIGKILLed the moment its session directory appears: the reaper was started first (for the path to
    come), so it removes the directory; before, a kill between the directory and the reaper left it for good."""
    root = fake_gpu.tmpdir
    for _ in range(5):
        job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", launcher,
                                "--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec",
                                "true"], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not fake_gpu.session_dirs() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        job.kill()
        job.wait()
        settle(fake_gpu)
        assert not fake_gpu.session_dirs(), list(root.rglob("*"))


def test_a_deferring_block_remembers_a_signal_that_comes_as_it_ends(monkeypatch):
    """``Interrupts(deferred=True)`` (a rank's supervisor ending its rank): a stopping signal that comes while the
    block ends, as its handlers are put back, is remembered, not raised. The pattern it replaced ended the deferral
    first, and a SIGTERM in between (the reaper's, as a killed mpsrun's session was reaped) raised a traceback."""
    from mpsrun.runtime import interrupts as module
    from mpsrun.runtime.constants import STOP_SIGNALS

    real_restore = module.restore_signals

    def signalled_while_restoring(previous):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, to the handler still in force
        real_restore(previous)

    monkeypatch.setattr(module, "restore_signals", signalled_while_restoring)
    with module.Interrupts(deferred=True) as interrupts:
        pass
    assert interrupts.received == [signal.SIGTERM]
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    try:
        with pytest.raises(module.InterruptionError), module.Interrupts() as old, old.deferred():  # the old pattern
            pass
    finally:  # the old pattern's raise left its handlers in force: not for the next test of this worker
        real_restore(handlers)


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_sigusr1_while_mpsrun_starts_is_not_fatal(fake_gpu, path):
    """SIGUSR1 to mpsrun once its session directory exists, before the ranks run: the job runs to its end (SIGUSR1's
    default action ended mpsrun with 138 and no word; under the mpiexec launcher ranks then could not reach it)."""
    job = subprocess.Popen(job_argv(path, [], ["sh", "-c", "sleep 1"], ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: fake_gpu.session_dirs(), what="no session directory", proc=job)
    for pid in supervisors(job, path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    settle(fake_gpu)
