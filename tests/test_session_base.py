"""Where a session's directory goes, and machines that cannot hold it: a full or inode-less tmpfs, a base that is
no place for directories (/proc), too few descriptors for the ranks, a relative MPSRUN_TMPDIR, a base reached
through another user's link. Each is one line and its exit code, at once, leaving nothing; each was once measured.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess

import pytest
from helpers import (
    MPSRUN,
    PATHS,
    fake,
    job_argv,
    mpiexec,
    run_job,
    settle,
)


@pytest.fixture
def full_tmpfs(short_tmp):
    """A tmpfs with room for one directory entry and nothing more (root only: mounting it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = short_tmp / "full"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=2,mode=1777", "tmpfs", str(mount)],
                          capture_output=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_full_session_base_is_one_line_and_exit_3(fake_gpu, full_tmpfs, monkeypatch, launcher):
    """MPSRUN_TMPDIR on a file system with no inode left: one line, exit 3, and nothing left in it (it was a
    30-line OSError traceback)."""
    monkeypatch.setenv("MPSRUN_TMPDIR", str(full_tmpfs))
    where = ["--mpiexec", mpiexec()] if launcher == "mpiexec" else []
    out = subprocess.run([*MPSRUN, "-np", "2", "--launcher", launcher, *where, "true"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stderr.count("\n") == 1 and "No space left on device" in out.stderr, out.stderr
    assert [p.name for p in full_tmpfs.rglob("*")] in ([], [f"mpsrun-{os.getuid()}"])


@pytest.fixture
def tight_tmpfs(short_tmp, request):
    """A tmpfs that holds the user's mpsrun directory and room for ``request.param`` more inodes in all (root only:
    mounting it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = short_tmp / "tight"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1m,nr_inodes={request.param + 2}", "tmpfs",
                           str(mount)], capture_output=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        (mount / f"mpsrun-{os.getuid()}").mkdir(mode=0o700)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


@pytest.mark.mpiexec
@pytest.mark.parametrize(("path", "tight_tmpfs"), [("hosts", 3), ("per-node", 11), ("hosts", 13), ("mpiexec", 11)],
                         indirect=["tight_tmpfs"])
def test_a_node_session_with_no_inode_left_is_one_line_and_leaves_nothing(fake_gpu, tight_tmpfs, monkeypatch, path):
    """A node's session runs out of inodes as it is made: the job ends with one line that says so, or runs. Found by
    the fifth hostile pass: under --hosts, a reservation's mark that did not fit left its directory for good, with a
    line per rank about 'the job's controller'; a per-node keeper that could not make its log died in silence (exit
    3, no word); one that could not make the output lock said 'node keeper failed: OSError(28, ...)'; under mpiexec
    that lock's failure was said beside 'the job's controller went away', and Hydra's banner. (Where the session's
    record does not fit under mpiexec or --hosts, Hydra's banner still comes: docs/command-line.md.)"""
    monkeypatch.setenv("MPSRUN_TMPDIR", str(tight_tmpfs))
    out = run_job(path, [], ["true"], ranks=2, timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert out.returncode == 0 or (out.returncode == 3 and len(lines) == 1 and "No space left on device" in lines[0]
                                   and "OSError" not in lines[0] and not out.stdout), out.stderr + out.stdout
    assert settle(fake_gpu, timeout=20.0), "the job left something"
    assert list(tight_tmpfs.rglob("*")) == [tight_tmpfs / f"mpsrun-{os.getuid()}"]


@pytest.mark.parametrize("tight_tmpfs", [10], indirect=True)
def test_a_farm_whose_record_fills_up_warns_once(fake_gpu, tight_tmpfs, monkeypatch, short_tmp):
    """A farm whose session record stops fitting as its tasks come and go: one warning, that the tasks' processes
    may outlive a killed mpsrun, and the farm runs on. It was a warning per task, with an empty pid list once the
    tasks had ended (sixth hostile pass)."""
    monkeypatch.setenv("MPSRUN_TMPDIR", str(tight_tmpfs))
    tasks = short_tmp / "tasks.txt"
    tasks.write_text("true\n" * 6)
    out = subprocess.run([*MPSRUN, "-np", "2", "--launcher", "local", "--tasks", str(tasks)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode in (0, 3), out.stderr
    assert out.stderr.count("warning") <= 1 and "pid  " not in out.stderr, out.stderr
    assert settle(fake_gpu, timeout=20.0)


@pytest.mark.mpiexec
@pytest.mark.parametrize("base", ["/proc", "/proc/self"])
@pytest.mark.parametrize("path", PATHS)
def test_a_session_base_that_is_no_place_for_directories_is_one_line_and_exit_3(fake_gpu, monkeypatch, path, base):
    """MPSRUN_TMPDIR=/proc or /proc/self: one "mpsrun: error:" line and exit 3 on every path, not a FileNotFoundError
    traceback (per-node and --hosts said 'No such file or directory: mpsrun-0' once per rank; --hosts left out
    "error:"); /proc/self, whose permissions allow no one to write, was exit 2, as a directory the user may not write
    is."""
    monkeypatch.setenv("MPSRUN_TMPDIR", base)
    out = subprocess.run(job_argv(path, [], ["true"], ranks=2), capture_output=True, text=True, timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert out.returncode == 3 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"mpsrun: error: cannot make a session directory under {base}"), out.stderr


def _open_files(limit: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return preexec


def test_too_few_open_files_for_the_ranks_is_one_line_and_exit_3(fake_gpu):
    """``ulimit -n 64`` and 40 local ranks: refused at once with one line and exit 3 (it ran into EMFILE half-way,
    printed tracebacks and kept the session directory); with only the soft limit low, it is raised and the job
    runs."""
    out = subprocess.run([*MPSRUN, "-np", "40", "--launcher", "local", "true"], capture_output=True, text=True,
                         timeout=120, preexec_fn=_open_files(64))
    assert out.returncode == 3 and out.stderr.count("\n") == 1 and "ulimit -n" in out.stderr, out.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip("this machine's hard limit is too low to show the raise")
    soft_only = subprocess.run([*MPSRUN, "-np", "40", "--launcher", "local", "sleep", "1"], capture_output=True,
                               text=True, timeout=120,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)))
    assert soft_only.returncode == 0, soft_only.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_a_relative_tmpdir_is_taken_from_the_working_directory(fake_gpu, short_tmp, monkeypatch, path):
    """MPSRUN_TMPDIR=relbase, relative to the working directory: the ranks are MPS clients of a daemon found at
    once (the daemon, which runs in a directory of its own, looked for a relative pipe directory there: 'did not
    answer within 30 s', exit 3)."""
    (short_tmp / "relbase").mkdir(mode=0o700)
    monkeypatch.chdir(short_tmp)
    monkeypatch.setenv("MPSRUN_TMPDIR", "relbase")
    reports = short_tmp / "reports"
    reports.mkdir()
    out = subprocess.run(job_argv(path, ["--mps", "on"], fake("--report-dir", str(reports)), ranks=2),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(json.loads(p.read_text())["mps"] for p in reports.glob("*.json")), out.stderr
    assert not list((short_tmp / "relbase").glob("mpsrun-*/*"))


def test_a_relative_tmpdir_serves_mps_session(fake_gpu, short_tmp, monkeypatch):
    """mps_session(tmpdir="relbase") starts its daemon at once (it timed out after 30 s)."""
    from mpsrun import mps_session

    (short_tmp / "relbase").mkdir(mode=0o700)
    monkeypatch.chdir(short_tmp)
    with mps_session(gpu=0, tmpdir="relbase") as session:
        assert session.enabled and os.path.isabs(session.env()["CUDA_MPS_PIPE_DIRECTORY"])


@pytest.fixture
def stranger() -> int:
    """A uid that no account has: to the kernel simply another user (root only: giving it a file)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    import pwd

    used = {entry.pw_uid for entry in pwd.getpwall()}
    return next(uid for uid in range(47000, 48000) if uid not in used)


def test_a_base_reached_through_another_users_link_is_refused(fake_gpu, stranger, short_tmp, monkeypatch):
    """MPSRUN_TMPDIR through a symbolic link another user owns (to a root-owned 1777 directory): refused with
    exit 3, since that user could point it elsewhere (only the link's target used to be checked)."""
    target = short_tmp / "shared-tmp"
    target.mkdir()
    target.chmod(0o1777)
    link = short_tmp / "their-link"
    link.symlink_to(target)
    os.lchown(link, stranger, stranger)
    monkeypatch.setenv("MPSRUN_TMPDIR", str(link))
    out = subprocess.run([*MPSRUN, "-np", "1", "--launcher", "local", "true"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3 and "symbolic link of uid" in out.stderr, out.stderr
    assert not list(target.iterdir())
