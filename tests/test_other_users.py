"""Another user of the machine: it cannot reach our session, clean it up, own our root, race our root's creation
(renameat2 swaps in a loop) or move our entries in a base it may write to. Run as root, the suite acts as that user
by an unused uid (no account is added).
"""

import grp
import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from helpers import ROOT, locked, other_user_venv

from mpsrun import UnsafeDirectoryError, mps_session
from mpsrun.session.paths import SessionDirs


class OtherUser(NamedTuple):
    """A second identity: its uid and gid, and a Python it can run with mpsrun installed."""

    uid: int
    gid: int
    python: str

    def as_them(self) -> dict:
        """Popen's arguments that run a process as this user (no group of ours kept)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


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
