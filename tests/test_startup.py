"""What made start-up and teardown cheaper (issue 13), each kept honest: the checks it must not drop.

The figures themselves are benchmarks (benchmarks/overhead.py, docs/benchmarks.md), never timed tests.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    PATHS,
    control_logs,
    fake,
    job_argv,
    per_node_ranks,
    remove_kept,
    running,
    settle,
    supervisors,
    wait_for,
    wait_processes_gone,
)

from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.gpus import GPU
from mpsrun.mps.replies import ServerStatus
from mpsrun.mps.watch import ClientWatcher, RankWatch
from mpsrun.runtime.processes import ProcessRef

pytestmark = pytest.mark.mpiexec


@pytest.mark.parametrize("path", PATHS)
def test_the_server_starts_with_the_first_client(fake_gpu, path):
    """As with a daemon started by hand, a short job whose ranks never touch the GPU starts no MPS server on any
    path (the launchers ask for one only 0.25 s after the first rank starts, and not once every rank has ended: a
    server's quit alone takes 0.1 s; one rank, so that a busy machine cannot start the ranks 0.25 s apart); a job
    whose ranks do use the GPU starts exactly one per daemon, and every rank is still proven connected."""
    out = subprocess.run(job_argv(path, ["--keep-logs"], ["true"], ranks=1), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    wait_processes_gone(fake_gpu)  # the session is kept: what the logs say is final once its processes are gone
    logs = control_logs(fake_gpu)
    assert logs and sum(text.count("Starting new server") for text in logs) == 0, logs
    remove_kept(fake_gpu)
    out = subprocess.run(job_argv(path, ["--keep-logs", "-v"], fake("--hold", "0.3")), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 of 3 ranks connected to MPS" in out.stderr, out.stderr
    wait_processes_gone(fake_gpu)
    assert sum(text.count("Starting new server") for text in control_logs(fake_gpu)) == 1
    remove_kept(fake_gpu)


class StubDaemon:
    """A daemon as the watch sees it: a log, a server list and a status per server."""

    def __init__(self, log_file: Path, status: ServerStatus) -> None:
        self.log_file, self.status, self.alive, self.asked = log_file, status, True, 0
        self.server_pids: list[int] = []

    def saw_server(self, pid, from_log=False):
        self.server_pids.append(pid)

    def server_list(self, timeout=None):
        return [4242]

    def server_status(self, pid, timeout=None):
        self.asked += 1
        return self.status


@pytest.mark.parametrize("status", [ServerStatus.ACTIVE, ServerStatus.FAULT])
def test_a_server_started_by_its_first_client_is_checked_once(fake_gpu, tmp_path, status):
    """The job's watch asks a server's state once its first client is in the daemon's log: FAULT fails the job
    (naming the server), ACTIVE passes; later looks do not ask again, and the log's server pid is remembered."""
    log = tmp_path / "control.log"
    log.write_text("[x Control 1] Starting new server 4242 for user 0\n[x Control 1] NEW SERVER 4242: Ready\n")
    daemon = StubDaemon(log, status)
    gpu = GPU(index=0, uuid=fake_gpu.uuids[0], name="Fake H100", memory_total=1, compute_mode="Default",
              mig_enabled=False)
    watch = RankWatch(ClientWatcher([gpu], [daemon]), required=True)
    assert watch.check({}) == [] and daemon.asked == 0  # a server, but no client yet
    with log.open("a") as out:
        out.write("[x Server 4242] Client {PID: 77, Context ID: 0} connected\n")
    findings = watch.check({77: 0})
    assert daemon.asked == 1 and daemon.server_pids == [4242]
    if status is ServerStatus.FAULT:
        assert len(findings) == 1 and findings[0].fatal and "4242" in findings[0].message
        assert "FAULT" in findings[0].message
    else:
        assert findings == [] and watch.verified == {0}
    with log.open("a") as out:
        out.write("[x Server 4242] Client {PID: 78, Context ID: 0} connected\n")
    watch.check({77: 0, 78: 1})
    assert daemon.asked == 1


def test_a_server_pid_from_the_log_counts_only_as_the_daemons_child(tmp_path):
    """Teardown checks that every server the log names is gone, killing one that is not: a pid from the log is
    remembered only while it is the daemon's child, never a process that has since taken the number."""
    daemon = ControlDaemon("GPU-x", tmp_path, tmp_path, process=ProcessRef.of(os.getpid()))  # we are "the daemon"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        daemon.saw_server(os.getppid(), from_log=True)  # alive, but not the daemon's child
        assert daemon.server_pids == []
        daemon.saw_server(child.pid, from_log=True)
        assert daemon.server_pids == [child.pid]
    finally:
        child.kill()
        child.wait()


RANK_VIEW = """
import json, os, signal, sys
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
handlers = {n: str(signal.getsignal(getattr(signal, n))) for n in names}
view = {"fds": fds, "handlers": handlers, "stdin": os.readlink("/proc/self/fd/0"), "own_session": os.getsid(0) == os.getpid(),
        "control": [k for k in os.environ if k.startswith("MPSRUN_CONTROL")]}
open(os.path.join(os.environ["VIEW_DIR"], os.environ["RANK"] + ".json"), "w").write(json.dumps(view))
"""


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_starts_as_clean_on_every_path(fake_gpu, short_tmp, monkeypatch, path):
    """However its supervisor was started (forked by the local launcher, or by an MPI launcher), a rank gets the
    default signal handling, its own session, no controller address, and /dev/null as stdin except rank 0; under
    the local launcher only descriptors 0-2 (MPI launchers hand ranks their own)."""
    monkeypatch.setenv("VIEW_DIR", str(short_tmp))
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", RANK_VIEW]), capture_output=True, text=True,
                         timeout=120, stdin=subprocess.PIPE)
    assert out.returncode == 0, out.stderr
    views = {int(p.stem): json.loads(p.read_text()) for p in short_tmp.glob("*.json")}
    assert sorted(views) == [0, 1, 2]
    for rank, view in views.items():
        assert view["handlers"]["SIGINT"] == str(signal.default_int_handler), view
        assert all(view["handlers"][n] == str(signal.SIG_DFL) for n in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"))
        assert view["own_session"] and view["control"] == []
        if rank > 0 and path == "local":
            assert view["stdin"] == "/dev/null"
        if path == "local":
            assert view["fds"][:3] == [0, 1, 2] and len(view["fds"]) == 4, view  # the 4th: the listing itself
    settle(fake_gpu)


def test_nvml_is_initialised_once_per_job(fake_gpu, short_tmp, monkeypatch):
    """The job's controller initialises NVML once (it used to for every query: GPUs, free memory, each look)."""
    log = short_tmp / "inits"
    monkeypatch.setenv("FAKE_NVML_INIT_LOG", str(log))
    job = subprocess.Popen(job_argv("local", ["--mem-limit", "auto"], fake("--hold", "1")), stderr=subprocess.PIPE,
                           text=True)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    inits = log.read_text().split()
    assert inits.count(str(job.pid)) == 1, inits
    settle(fake_gpu)


def test_the_rank_shim_reads_only_its_own_option_pairs():
    """The shim's own line, as mpsrun writes it: ``--name N`` pairs, ``--``, the command; anything else (an
    unknown name, a value that is not a whole number, a name without a value, no ``--``) is a usage error."""
    from mpsrun.rank.cli import _parse

    assert _parse(["--rank", "3", "--local-rank", "1", "--size", "4", "--local-size", "2", "--", "a", "-b"]) == (
        {"rank": 3, "local_rank": 1, "size": 4, "local_size": 2}, ["a", "-b"])
    assert _parse(["--", "a"]) == ({}, ["a"])
    for bad in (["--rank", "x", "--", "a"], ["--rank", "--", "a"], ["--ranks", "1", "--", "a"], ["--rank", "1"]):
        with pytest.raises(SystemExit, match="usage"):
            _parse(bad)


LINGERING_MPIEXEC = Path(__file__).resolve().parent / "programs" / "lingering_mpiexec.py"


@pytest.mark.parametrize("exit_code", [0, 5])
def test_the_daemons_quit_while_the_mpi_launcher_winds_down(fake_gpu, short_tmp, monkeypatch, exit_code):
    """Once every rank has ended, the daemons are stopped while the MPI launcher takes its time to exit
    (Open MPI's mpirun takes about 100 ms, and so does a server's quit): not one after the other. The job's
    outcome and its report are the same, with no word of a daemon that stopped on its own."""
    wrapper = short_tmp / "mpiexec"
    wrapper.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(LINGERING_MPIEXEC)!r}\n"
                       f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("LINGER_REPORT", str(short_tmp / "report.json"))
    program = [sys.executable, "-c", f"import os, sys; sys.exit({exit_code} if os.environ['RANK'] == '1' else 0)"]
    result = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "mpiexec", "--mpiexec",
                             str(wrapper), *program], capture_output=True, text=True, timeout=120)
    assert result.returncode == exit_code, result.stderr
    assert json.loads((short_tmp / "report.json").read_text()) == {"daemons_gone": True}
    assert "daemon stopped" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    if exit_code:
        assert "rank 1 (pid" in result.stderr and f"exited with code {exit_code} first" in result.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_the_daemons_of_several_gpus_start_together_and_end_together(fake_gpu, launcher):
    """Each GPU's daemon is started before any is waited for (they come up side by side); a signal while none
    answers yet ends every one of them at once (no quit to wait for): one line, 143, nothing left behind."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    where = ["--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"] \
        if launcher == "mpiexec" else []
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", launcher, "--gpus", "all",
                            *where, "true"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(list(fake_gpu.tmpdir.rglob("control.log"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # each daemon's log is made when the daemon is started
    started = len(list(fake_gpu.tmpdir.rglob("control.log")))
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=8)  # not the 10 s a daemon gets to answer `quit`
    assert job.returncode == 143 and err == "mpsrun: error: interrupted by SIGTERM\n", err
    settle(fake_gpu)
    assert started == 2, "the second daemon was started only once the first answered"


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


SERVED = ("for i in $(seq 600); do grep -qs 'Starting new server' \"$MPSRUN_SESSION_DIR\"/gpu*/log/control.log "
          "&& exit 0; sleep 0.05; done")


@pytest.mark.parametrize("path", ["local", "mpiexec"])
@pytest.mark.parametrize(("program", "servers"), [
    (["sh", "-c", SERVED], 1),
    (["sh", "-c", 'if [ "$RANK" = 1 ]; then exit 3; fi; trap "" TERM; sleep 1'], 0),  # rank 0 outlives the stop
])
def test_the_launchers_ask_for_the_server_while_the_ranks_start(fake_gpu, path, program, servers):
    """Each server is asked for 0.25 s after the last rank has started, before ranks that import a GPU framework reach
    CUDA (its first client would otherwise wait for it): a job still running then gets its server without any
    client (its ranks, no CUDA clients, run until the daemon's log says it started one, or 30 s), and its teardown
    ends it; a job already stopping (a rank failed) asks for none."""
    out = subprocess.run(job_argv(path, ["--keep-logs"], program, ranks=2), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == (0 if servers else 3), out.stderr
    wait_processes_gone(fake_gpu)  # the session is kept: what the logs say is final once its processes are gone
    assert sum(text.count("Starting new server") for text in control_logs(fake_gpu)) == servers
    remove_kept(fake_gpu)


def test_the_server_is_asked_for_once_the_last_rank_has_started():
    """The cue to ask for the servers comes once, when the last of the job's ranks has started (a rank heard twice
    counts once), never at the first rank's start: 48 short ranks took as long to start as the server's wait, and
    the job paid for a server nobody used. Without a wait (None) there is no cue."""
    from mpsrun.agent.agent import ServerCue

    cue = ServerCue(range(3), 0.25)
    assert [cue.started(r) for r in (0, 0, 2)] == [None, None, None]
    assert cue.started(1) == 0.25
    assert cue.started(1) is None and cue.started(0) is None
    lazy = ServerCue(range(1), None)
    assert lazy.started(0) is None


@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_no_gpu_list_is_read_ahead_where_node_keepers_read_it(fake_gpu, path):
    """Under --per-node and --hosts each host's node keeper reads the GPUs: the launcher and the per-node ranks
    fork no read-ahead child, which would stay a zombie under them for the whole job."""
    import psutil

    job = subprocess.Popen(job_argv(path, [], ["sleep", "2"], ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(running(job, ["sleep", "2"])) == 2, what="the ranks did not start", proc=job)
    zombies = []
    for proc in psutil.Process(job.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a process that ended meanwhile is no zombie of ours
            if proc.status() == psutil.STATUS_ZOMBIE:
                zombies.append(proc.pid)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert zombies == []
    settle(fake_gpu)


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


def test_only_the_jobs_token_admits_a_rank():
    """The controller admits a hello only with the job's token (compared in constant time; OpenSSL's
    compare_digest is imported with the controller, while the daemons start, not at the first hello)."""
    from mpsrun.agent.ranks import token_matches
    from mpsrun.runtime.protocol import new_token

    token = new_token()
    assert token_matches(token, token)
    assert not token_matches(new_token(), token) and not token_matches(token[:-1], token)
    assert not token_matches(None, token) and not token_matches(token.encode(), token)


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
