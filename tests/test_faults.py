"""Reliability on the fake machine: the fault matrix, stale sessions, security, arguments, load.

After every test the fake_gpu fixture checks that no process of the job survived (ranks,
daemons, servers, even reparented ones) and that no session directory is left.
"""

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from helpers import ROOT, fake, locked, mpsrun, other_user_venv, wait_for

from mpsrun import UnsafeDirectoryError, mps_session
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import SessionDirs
from mpsrun.session.record import DaemonRecord, SessionRecord


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


def test_daemon_killed_under_a_running_job(fake_gpu, short_tmp):
    """Killing the daemon under a running job fails the job and the summary says the daemon stopped."""
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "--grace", "1",
                            *fake("--report-dir", str(short_tmp), "--hold", "60")],
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2)
    [root] = fake_gpu.session_dirs()
    daemon_pid = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon_pid, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0
    assert "MPS control daemon" in err and ("died under the job" in err or "stopped" in err)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_awkward_arguments_reach_the_rank_intact(fake_gpu, launcher):
    """Spaces, quotes, ;, $(...), globs and non-UTF-8 bytes reach the rank unchanged: no shell anywhere."""
    if launcher == "mpiexec" and shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("no mpiexec")
    awkward = ["a b", '"quoted"', "it's", "x;y", "$(touch /tmp/mpsrun-pwned)", "*", "\\n", os.fsdecode(b"caf\xe9")]
    code = "import os, sys; sys.stdout.buffer.write(repr([os.fsencode(a) for a in sys.argv[1:]]).encode())"
    args = ["-np", "1", "--launcher", launcher]
    if launcher == "mpiexec":
        args += ["--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable))]
    out = subprocess.run([sys.executable, "-m", "mpsrun", *args, sys.executable, "-c", code, *awkward],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == repr([os.fsencode(a) for a in awkward])
    assert not Path("/tmp/mpsrun-pwned").exists()


def test_two_jobs_at_once_on_the_same_gpu_each_get_their_own_daemon(fake_gpu, short_tmp):
    """Two mpsrun jobs on one GPU at the same time: separate daemons and directories, both succeed."""
    reports = [short_tmp / "a", short_tmp / "b"]
    for directory in reports:
        directory.mkdir()
    jobs = [subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local",
                              *fake("--report-dir", str(d), "--hold", "2")]) for d in reports]
    assert [job.wait(timeout=60) for job in jobs] == [0, 0]
    pipes = [{json.loads(p.read_text())["env"]["CUDA_MPS_PIPE_DIRECTORY"] for p in d.glob("*.json")} for d in reports]
    assert len(pipes[0]) == len(pipes[1]) == 1 and pipes[0] != pipes[1]


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


def _make_python(base: str, env_dir: Path) -> None:
    """A virtual environment of ``base`` (no pip of its own) with mpsrun's dependencies, installed by our pip, and
    a copy of this checkout's mpsrun: nothing is built."""
    env_dir.mkdir(mode=0o755, exist_ok=True)
    os.chmod(env_dir, 0o755)
    python = env_dir / "bin" / "python"
    made = subprocess.run([base, "-m", "venv", "--without-pip", str(env_dir)], capture_output=True)
    if made.returncode == 0:
        requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        made = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *requirements],
                              capture_output=True, timeout=600)
    if made.returncode != 0:
        pytest.skip(f"could not make a Python with mpsrun for a second user: {made.stderr[-300:]!r}")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shutil.copytree(ROOT / "mpsrun", Path(site) / "mpsrun", ignore=shutil.ignore_patterns("__pycache__"))
    (env_dir / "made").touch()


class OtherUser(NamedTuple):
    """A second identity: its uid and gid, and a Python it can run with mpsrun installed."""

    uid: int
    gid: int
    python: str

    def as_them(self) -> dict:
        """Popen's arguments that run a process as this user (no group of ours kept)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def _unused_id() -> int:
    """A number that is no account's uid and no group's gid here (nor, so, the owner of anything of theirs)."""
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    start = 61000 + os.getpid() % 3000  # two suites at once (a loaded machine) pick apart
    return next(n for n in range(start, start + 4000) if n not in taken)


@pytest.fixture(scope="session")
def other_user():
    """A second user: as root, a uid and gid that no account has, so nothing on the machine is added or changed
    (no useradd, no /etc/passwd entry); to the kernel it is simply another user. Elsewhere skipped.

    Our own interpreter may live under /root, which other users cannot enter, so the other
    user gets a virtual environment of its own, made from a system Python, outside /root: once
    per test run (xdist's workers share it), removed when the run ends (conftest.py).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user")
    base = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if base is None:
        pytest.skip("no system Python for the second user")
    env_dir = other_user_venv()
    python = env_dir / "bin" / "python"
    user = OtherUser(_unused_id(), _unused_id(), str(python))
    with locked(Path(__file__)):  # one worker makes it; the others wait for it here
        if not (env_dir / "made").exists():
            _make_python(base, env_dir)
    check = subprocess.run([str(python), "-c", "import mpsrun.session.registry"], capture_output=True, cwd="/tmp",
                           **user.as_them())
    if check.returncode != 0:
        pytest.skip(f"uid {user.uid} cannot run mpsrun from {env_dir}: {check.stderr[-300:]!r}")
    return user


def test_another_user_cannot_reach_the_session(fake_gpu, other_user):
    """Another user can neither list the pipe directory, nor connect to the control socket, nor read the log."""
    with mps_session() as session:
        pipe, log = session.daemons[0].pipe_dir, session.daemons[0].log_file
        probe = (
            "import os, socket, sys\n"
            "results = []\n"
            f"for attempt in (lambda: os.listdir({str(pipe)!r}), lambda: open({str(log)!r}).read(),\n"
            f"                lambda: socket.socket(socket.AF_UNIX).connect({str(pipe / 'control')!r})):\n"
            "    try:\n"
            "        attempt(); results.append('ALLOWED')\n"
            "    except PermissionError:\n"
            "        results.append('denied')\n"
            "print(results)\n"
        )
        out = subprocess.run([other_user.python, "-c", probe], capture_output=True, text=True, cwd="/tmp", timeout=30,
                             **other_user.as_them())
        assert out.stdout.strip() == "['denied', 'denied', 'denied']", out.stderr
        assert session.daemons[0].alive


def test_another_users_cleanup_does_not_touch_our_session(fake_gpu, other_user):
    """mpsrun cleanup --force run by another user, naming our session, leaves it alone."""
    os.chmod(fake_gpu.root, 0o755)
    os.chmod(fake_gpu.tmpdir, 0o1777)  # a shared base, like /tmp
    with mps_session() as session:
        env = {"PATH": os.environ["PATH"], "MPSRUN_TMPDIR": str(fake_gpu.tmpdir)}
        out = subprocess.run([other_user.python, "-m", "mpsrun", "cleanup", "--force", session.dirs.session_id],
                             capture_output=True, text=True, cwd="/tmp", env=env, timeout=60, **other_user.as_them())
        assert out.returncode == 2 and "no session" in out.stderr, out.stdout + out.stderr
        assert session.dirs.root.exists() and session.daemons[0].alive
    shutil.rmtree(fake_gpu.tmpdir / f"mpsrun-{other_user.uid}", ignore_errors=True)


def test_user_root_owned_by_another_user_is_refused(fake_gpu, other_user):
    """A pre-existing mpsrun-<uid> directory owned by someone else is refused (it could be a trap)."""
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    root.mkdir(mode=0o700)
    os.chown(root, other_user.uid, other_user.gid)
    try:
        with pytest.raises(UnsafeDirectoryError, match=f"owned by uid {other_user.uid}"), mps_session():
            pass
    finally:
        root.rmdir()


def test_control_socket_itself_is_open_but_the_directory_guards_it(fake_gpu):
    """The daemon makes its socket world-accessible (as NVIDIA's does); the session directory is 0700."""
    with mps_session() as session:
        pipe = session.daemons[0].pipe_dir
        assert (session.dirs.root.stat().st_mode & 0o777) == 0o700
        assert (pipe.stat().st_mode & 0o777) == 0o700
        with socket.socket(socket.AF_UNIX) as conn:  # we, the owner, can connect
            conn.connect(str(pipe / "control"))


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_an_interrupt_during_start_up_is_one_line(fake_gpu, sig, launcher):
    """A signal while the daemon starts (one that never answers): one line, exit 128+N, nothing left."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    where = ["--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"] \
        if launcher == "mpiexec" else []
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", launcher, *where, "true"],
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: list(fake_gpu.tmpdir.rglob("control.log")), proc=job)  # the daemon was started
    job.send_signal(sig)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 128 + sig
    assert err == f"mpsrun: error: interrupted by {signal.Signals(sig).name}\n"
    wait_for(lambda: not fake_gpu.session_dirs() and not fake_gpu.orphans())


def test_cleanup_refuses_a_session_that_is_not_there(fake_gpu):
    """mpsrun cleanup --force NAME for a session that does not exist says so and exits 2."""
    out = mpsrun("cleanup", "--force", "s-nope")
    assert out.returncode == 2 and "no session s-nope of yours here" in out.stderr


RACER = """
import ctypes, os, sys, time
base, stop = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs(os.path.join(base, "evil"), exist_ok=True)
link = os.path.join(base, "evil-link")
if not os.path.islink(link):
    os.symlink(os.path.join(base, "evil"), link)
ours, theirs = os.path.join(base, "mpsrun-0").encode(), link.encode()
tries = wins = 0
print("racing", flush=True)
while not os.path.exists(stop):
    tries += 1
    if libc.renameat2(-100, ours, -100, theirs, 2) == 0:  # RENAME_EXCHANGE
        wins += 1
        libc.renameat2(-100, ours, -100, theirs, 2)
print(tries, wins, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)  # sessions made while a racer spins a core: slow beside the other tests
def test_a_second_user_cannot_race_the_session_root(fake_gpu, other_user, short_tmp):
    """Another user swapping our mpsrun-<uid> with a link to their own directory (renameat2 RENAME_EXCHANGE, in a
    loop) wins 0 of 2,000 session creations in a sticky shared base; a base they own is refused outright. (10,000
    held too, but the racer spins a whole core for as long: on 2 cores that was a third of the suite's time.)"""
    os.chmod(fake_gpu.root, 0o755)
    os.chmod(fake_gpu.tmpdir, 0o1777)  # like /tmp: shared, sticky, root's
    stop = fake_gpu.tmpdir / "stop"
    racer = subprocess.Popen([other_user.python, "-c", RACER, str(fake_gpu.tmpdir), str(stop)],
                             stdout=subprocess.PIPE, text=True, cwd="/tmp", **other_user.as_them())
    try:
        assert racer.stdout.readline().strip() == "racing"  # it swaps from the first session on
        for _ in range(2_000):
            dirs = SessionDirs.create(fake_gpu.tmpdir, [0])
            assert os.lstat(dirs.root.parent).st_uid == os.getuid() and not dirs.root.parent.is_symlink()
            dirs.remove()
    finally:
        stop.touch()
        tries, wins = map(int, racer.communicate(timeout=60)[0].split())
    assert tries > 100 and wins == 0
    assert list((fake_gpu.tmpdir / "evil").iterdir()) == []
    os.chown(fake_gpu.tmpdir, other_user.uid, other_user.gid)  # a base the other user owns: they could move anything
    with pytest.raises(UnsafeDirectoryError, match="owned by uid"):
        SessionDirs.create(fake_gpu.tmpdir, [0])
    for name in ("evil-link", "evil", "stop"):
        path = fake_gpu.tmpdir / name
        path.unlink() if path.is_symlink() or path.is_file() else shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_base_others_may_write_without_the_sticky_bit_is_refused(fake_gpu, mode):
    """A base directory that others may write to and that has no sticky bit is refused: they could move our root."""
    os.chmod(fake_gpu.tmpdir, mode)
    with pytest.raises(UnsafeDirectoryError, match="no sticky bit"):
        SessionDirs.create(fake_gpu.tmpdir, [0])
    os.chmod(fake_gpu.tmpdir, 0o700)


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
