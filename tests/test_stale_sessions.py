"""What killed runs leave, and how it goes: the next session or `mpsrun cleanup` removes it (an orphaned daemon
stopped by pid and start time), a live session is left alone unless forced, a corrupt record or a link among the
sessions is reported and removed (never what a link points to), and many sessions in a row leak nothing.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import fake, mpsrun, wait_for

from mpsrun import mps_session
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import SessionDirs
from mpsrun.session.record import DaemonRecord, SessionRecord


def test_mpsrun_sigkilled_leaves_nothing_behind(fake_gpu, short_tmp):
    """SIGKILL to mpsrun: the daemon dies with it (parent-death signal), the rank supervisors stop their ranks
    (their controller is gone), and the session's reaper removes the directory: nothing is left, no cleanup needed."""
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "--grace", "1",
                            *fake("--report-dir", str(short_tmp), "--hold", "60")], stderr=subprocess.DEVNULL)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2)
    [root] = fake_gpu.session_dirs()
    daemon_pid = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    job.kill()
    job.wait()
    wait_for(lambda: not psutil.pid_exists(daemon_pid) or psutil.Process(daemon_pid).status() == "zombie")
    wait_for(lambda: not fake_gpu.orphans())
    wait_for(lambda: not root.exists())
    assert json.loads(mpsrun("status", "--json").stdout) == []


def _orphan_session(fake_gpu):
    """A session whose owner is gone but whose daemon still runs (no parent-death signal, no reaper)."""
    dirs = SessionDirs.create(fake_gpu.tmpdir, [0])
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(dirs.pipe_dir(0)), "CUDA_VISIBLE_DEVICES": fake_gpu.uuids[0]}
    log = open(dirs.log_dir(0) / "control.log", "wb")
    daemon = subprocess.Popen([str(fake_gpu.bin_dir / "nvidia-cuda-mps-control"), "-f"], env=env, stdout=log,
                              start_new_session=True)
    log.close()
    wait_for(lambda: (dirs.pipe_dir(0) / "control").exists())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    SessionRecord(kind="job", owner=ProcessRef(gone.pid, 1), uid=os.getuid(), started=time.time(),
                  daemons=(DaemonRecord(fake_gpu.uuids[0], ProcessRef.of(daemon.pid), str(dirs.pipe_dir(0)),
                                        str(dirs.log_dir(0))),)).write(dirs.record_file)
    return dirs, daemon


def test_cleanup_stops_an_orphaned_daemon_by_pid_and_start_time(fake_gpu):
    """cleanup stops a stale session's still-running daemon (verified by pid and start time) and removes it."""
    dirs, daemon = _orphan_session(fake_gpu)
    assert "GONE" in mpsrun("status").stdout
    out = mpsrun("cleanup")
    assert "1 daemon(s) stopped" in out.stdout, out.stdout
    assert daemon.wait(timeout=10) is not None
    assert not dirs.root.exists()


def test_next_session_removes_what_a_killed_run_left(fake_gpu):
    """Starting a session first cleans up this user's stale sessions (the 'next run' of the fault matrix)."""
    dirs, daemon = _orphan_session(fake_gpu)
    with mps_session():
        assert not dirs.root.exists()
        assert daemon.wait(timeout=10) is not None


def test_live_session_is_left_alone_unless_forced(fake_gpu):
    """cleanup never touches a live session; --force with its name stops and removes it."""
    session = mps_session().start()
    try:
        out = mpsrun("cleanup")
        assert out.stdout.strip() == "mpsrun cleanup: nothing to clean up"
        assert session.dirs.root.exists() and session.daemons[0].alive
        out = mpsrun("cleanup", "--force", session.dirs.session_id)
        assert f"{session.dirs.session_id}: removed (forced" in out.stdout
        wait_for(lambda: not session.daemons[0].alive)
        assert not session.dirs.root.exists()
    finally:
        session.close()


def test_cleanup_refuses_a_session_that_is_not_there(fake_gpu):
    """mpsrun cleanup --force NAME for a session that does not exist says so and exits 2."""
    out = mpsrun("cleanup", "--force", "s-nope")
    assert out.returncode == 2 and "no session s-nope of yours here" in out.stderr


def test_a_killed_program_using_mps_session_leaves_nothing(fake_gpu):
    """A Python program SIGKILLed inside `with mps_session()`: its session's reaper stops the daemon and removes the
    directory, with no cleanup run."""
    code = ("import sys, time\nfrom mpsrun import mps_session\n"
            "with mps_session() as s:\n    print(s.dirs.root, flush=True)\n    time.sleep(60)\n")
    program = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    root = Path(program.stdout.readline().strip())
    program.stdout.close()
    assert root.is_dir()
    program.kill()
    program.wait()
    wait_for(lambda: not root.exists() and not fake_gpu.orphans())


@pytest.mark.slow
@pytest.mark.timeout(300)  # 6 s on 2 cores alone; several times that beside the other workers
def test_many_sessions_leak_nothing(fake_gpu):
    """40 back-to-back sessions in one process leave no file descriptor, thread, child or directory.

    Slow on purpose (about 6 s on 2 cores: each session starts and stops a daemon): the counts after the sessions
    must equal those before, so a leak of one descriptor or thread in every session fails at once, and one that only
    some sessions leave (a race in a teardown) gets 40 chances to show. (100 took 17 s of CPU, the suite's largest
    share.)"""
    def snapshot():
        children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        return len(os.listdir("/proc/self/fd")), threading.active_count(), len(children)

    with mps_session():  # warm-up: first imports, the user root directory
        pass
    before = snapshot()
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0:  # the run's longest test: its sessions go ahead of the other xdist workers' tests
        os.setpriority(os.PRIO_PROCESS, 0, priority - 5)
    try:
        for _ in range(40):
            with mps_session() as session:
                assert session.enabled
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, priority)
    assert snapshot() == before
    assert fake_gpu.session_dirs() == []


_STARTED = '{"kind": "job", "owner": {"pid": 999999999, "start": 1}, "uid": 0, "started": %s}'


@pytest.mark.parametrize("content", ['{"daemons":[{"gpu":"x"}]}', "[1,2,3]", '{"pid":"abc"}', "not json",
                                     _STARTED % ("1" + "0" * 400), _STARTED % "1e400", _STARTED % "NaN"],
                         ids=["fields", "list", "pid", "text", "huge-start", "infinite-start", "nan-start"])
def test_a_corrupt_record_is_reported_and_cleaned(fake_gpu, content):
    """A session.json that holds no session record: status says it is unreadable (no traceback), and cleanup (also the
    automatic one of a new session) removes the directory once nothing of it runs. A start past a float, infinite
    or not a number (as Python's JSON reads them) is no record either: it ended status, top and cleanup in a
    traceback (OverflowError), or made status --json print NaN, which is no JSON."""
    dirs = SessionDirs.create(fake_gpu.tmpdir, [0])
    dirs.record_file.write_text(content)
    os.utime(dirs.root, (time.time() - 3600, time.time() - 3600))
    status = mpsrun("status")
    assert status.returncode == 0 and "unreadable" in status.stdout and "Traceback" not in status.stderr
    assert json.loads(mpsrun("status", "--json").stdout)[0]["problem"].startswith("unreadable record")
    with mps_session():
        assert not dirs.root.exists()


def test_a_link_in_the_session_root_is_only_unlinked(fake_gpu, short_tmp):
    """A symbolic link among the sessions is listed as such and cleanup removes the link, never what it points to."""
    target = short_tmp / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    SessionDirs.create(fake_gpu.tmpdir, []).remove()
    (root / "s-link").symlink_to(target)
    assert "a symbolic link" in mpsrun("status").stdout
    out = mpsrun("cleanup")
    assert "s-link: removed (a symbolic link)" in out.stdout, out.stdout + out.stderr
    assert (target / "keep").exists() and not (root / "s-link").exists()
