"""When a job's MPS daemons and servers start and end, on every path: a server with its first client, asked for while the
ranks start and checked once, the daemons of several GPUs together, their quit while the MPI launcher winds down;
NVML and the GPU list read once, where they are needed.

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

import pytest
from helpers import (
    PATHS,
    control_logs,
    fake,
    job_argv,
    remove_kept,
    running,
    settle,
    wait_for,
    wait_processes_gone,
)

from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.gpus import GPU
from mpsrun.mps.replies import ServerStatus
from mpsrun.mps.watch import ClientWatcher, RankWatch
from mpsrun.runtime.processes import ProcessRef

pytestmark = pytest.mark.mpiexec


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


SERVED = ("for i in $(seq 600); do grep -qs 'Starting new server' \"$MPSRUN_SESSION_DIR\"/gpu*/log/control.log "
          "&& exit 0; sleep 0.05; done")


LINGERING_MPIEXEC = Path(__file__).resolve().parent / "programs" / "lingering_mpiexec.py"


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
