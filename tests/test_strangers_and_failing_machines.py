"""Strangers and machines that fail the job: each once measured, reproduced as a test.

A stranger's bytes on a --hosts job's control port, options smuggled into ssh through --hosts, an
mpiexec that ends without starting its ranks, a machine that refuses files or descriptors, and bad
values to mpsrun.shared and mpsrun bench: each is one line and its exit code, at once, leaving nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    MPSRUN,
    PATHS,
    Output,
    daemon_session,
    descendants,
    fake,
    job_argv,
    mpiexec,
    per_node_ranks,
    run_job,
    settle,
    supervisors,
    wait_for,
    wait_processes_gone,
)

from mpsrun.errors import SharedArrayError

PYTHON_PASS = [sys.executable, "-c", "pass"]  # the no_gpu fixture's PATH finds nothing
FAKE_HYDRA = """#!/bin/sh
case "$1" in --version) echo "HYDRA build details:"; echo "    Version: 4.1.2"; exit 0;; esac
{body}
"""


def _fake_mpiexec(directory: Path, body: str) -> str:
    """An mpiexec that says it is MPICH's Hydra, then runs ``body`` (a shell snippet) instead of starting ranks."""
    path = directory / "mpiexec"
    path.write_text(FAKE_HYDRA.format(body=body))
    path.chmod(0o755)
    return str(path)


def _control_port(job: subprocess.Popen[str]) -> tuple[str, int]:
    """The --hosts controller's TCP address, as its per-node ranks were told it."""
    def address() -> str | None:
        for proc in psutil.Process(job.pid).children(recursive=True):
            try:
                value = proc.environ().get("MPSRUN_CONTROL", "")
            except psutil.Error:
                continue
            if value.startswith("tcp:"):
                return value
        return None

    host, _, port = wait_for(address, 60, "no per-node rank was told the controller's address", proc=job)[4:] \
        .rpartition(":")
    return host, int(port)


def _send(address: tuple[str, int], data: bytes, hold: float = 0.0) -> None:
    with socket.create_connection(address, timeout=5) as conn:
        try:
            conn.sendall(data)
        except OSError:  # the controller dropped us: that is its answer
            return
        time.sleep(hold)


def test_strangers_on_the_control_port_do_not_end_a_hosts_job(fake_gpu, short_tmp):
    """The line ``{x`` used to kill any --hosts job (a SystemError out of the private JSON scanner). Now garbage,
    unterminated and oversized lines, nested JSON, a wrong token, valid messages before a hello, a seeded fuzz of
    200 random lines and 100 held connections all reach a live controller, and the job still ends with exit 0."""
    release = short_tmp / "release"  # (the ranks run until every stranger has come)
    job = subprocess.Popen(job_argv("hosts", [], fake("--hold", "0", "--until-file", str(release)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    address = _control_port(job)
    rng = random.Random(25)  # noqa: S311 - a reproducible fuzz, not a secret
    lines = [b"{x\n", b"[" * 100_000 + b"\n", b"\xff\xfe\x00\n", b'{"type": "exited", "rank": 0, "returncode": 3}\n',
             b'{"type": "hello", "role": "node", "token": "wrong"}\n', b"x" * (2 << 20),
             *(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) + b"\n" for _ in range(200))]
    for line in lines:
        _send(address, line)
    held = [socket.create_connection(address, timeout=5) for _ in range(100)]
    release.touch()
    _, err = job.communicate(timeout=120)
    for conn in held:
        conn.close()
    assert job.returncode == 0, err
    settle(fake_gpu)


@pytest.mark.parametrize("hosts", ["-x", "bad host", "a,-oProxyCommand=x", "a:b"])
def test_hosts_are_validated_like_host_file_lines(no_gpu, hosts):
    """``--hosts -x`` reached ssh as an option and ``'bad host'`` gave Hydra's exit 255: each is now one line and
    exit 2, before anything starts."""
    out = subprocess.run([*MPSRUN, "-np", "2", "--hosts", hosts, "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "must name hosts" in out.stderr


@pytest.mark.parametrize("path", ["mpiexec", "hosts"])
def test_an_mpiexec_that_ends_without_its_ranks_is_reported_at_once(fake_gpu, short_tmp, path):
    """An mpiexec that exits 1 after 0.5 s without starting a rank: the job ends with mpiexec's code and says so,
    on both launchers that use one (under --hosts it used to wait forever)."""
    launcher = _fake_mpiexec(short_tmp, "sleep 0.5; exit 1")
    where = ["--hosts", "localhost"] if path == "hosts" else ["--launcher", "mpiexec"]
    out = subprocess.run([*MPSRUN, "-np", "2", *where, "--mpiexec", launcher, "true"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "mpiexec exited with code 1 before rank(s) 0-1 started" in out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("launcher", ["/bin/false", "/bin/true", "exit-1-later"])
def test_a_hosts_job_whose_mpiexec_is_no_mpi_launcher_is_refused_at_once(no_gpu, launcher):
    """``--hosts localhost --mpiexec /bin/false`` (or /bin/true, or a script that exits 1 after 0.5 s) still ran
    after 10 minutes, deaf to SIGTERM: mpsrun cannot tell how to name the hosts to it, and now says so (exit 2)
    before anything starts."""
    if launcher == "exit-1-later":
        script = no_gpu / "mpiexec"
        script.write_text("#!/bin/sh\nsleep 0.5\nexit 1\n")
        script.chmod(0o755)
        launcher = str(script)
    out = subprocess.run([*MPSRUN, "-np", "2", "--hosts", "localhost", "--mpiexec", launcher, *PYTHON_PASS],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot tell how this mpiexec takes hosts" in out.stderr, out.stderr


def test_a_signal_ends_a_hosts_job_whose_mpiexec_never_starts_its_ranks(fake_gpu, short_tmp):
    """An mpiexec that hangs without starting ranks: SIGTERM to mpsrun ends the job (143) within --grace and its
    own deadlines; SIGTERM and SIGINT used to print 'stopping' and leave it running."""
    launcher = _fake_mpiexec(short_tmp, "exec sleep 300")
    job = subprocess.Popen([*MPSRUN, "-np", "2", "--grace", "1", "--hosts", "localhost", "--mpiexec", launcher,
                            "true"], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: descendants(job, "sleep 300"), 30, "mpiexec did not start", proc=job)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 143, err
    settle(fake_gpu)


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


@pytest.fixture
def host_session(short_tmp, monkeypatch):
    """A session directory for mpsrun.shared in this process, with host memory (no GPU here)."""
    session = short_tmp / "session"
    session.mkdir(mode=0o700)
    monkeypatch.setenv("MPSRUN_SESSION_DIR", str(session))
    return session


@pytest.mark.parametrize(("args", "kwargs", "why"), [
    (("d", (1,) * 33, "f4"), {}, "at most 32 dimensions"),
    (("s", 4, "S0"), {}, "a dtype with a size"),
    (("v", 4, "V0"), {}, "a dtype with a size"),
    (("sub", 4, "(2,)f4"), {}, "no sub-array"),
    (("big", (1 << 61,), "u1"), {}, "GiB here (the host's available memory)"),
    (("shape", 4, "f8"), {"data": [1.0, 2.0, 3.0]}, "data of shape (3,)"),
])
def test_bad_shared_arrays_are_refused_at_once(host_session, args, kwargs, why):
    """Each of the hostile pass's raw exceptions (NumPy's ValueError, OSError ENOMEM, a broadcast error) or hangs
    (a 2 EiB zero-fill) is now a SharedArrayError naming the problem, before anything is allocated."""
    from mpsrun import shared

    started = time.monotonic()
    with pytest.raises(SharedArrayError, match=why.replace("(", r"\(").replace(")", r"\)")):
        shared.array(*args, **kwargs)
    assert time.monotonic() - started < 10


def test_an_init_that_asks_for_its_own_array_is_refused(host_session):
    """An init that asks for the array it fills used to deadlock, ignoring timeout=3: it is an error at once."""
    from mpsrun import shared

    def init(out: object) -> None:
        shared.array("same", 4, "f8", timeout=3)

    with pytest.raises(SharedArrayError, match="asks for 'same' itself"):
        shared.array("same", 4, "f8", init=init, timeout=3)


@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_session_directory_that_cannot_hold_shared_arrays_is_refused(short_tmp, monkeypatch, where):
    """A bogus MPSRUN_SESSION_DIR, or ``shared`` there being a file: a SharedArrayError, not an OSError."""
    from mpsrun import shared

    session = short_tmp / "session"
    if where == "file":
        session.mkdir()
        (session / "shared").write_text("not a directory")
    monkeypatch.setenv("MPSRUN_SESSION_DIR", str(session))
    with pytest.raises(SharedArrayError, match="cannot use"):
        shared.array("x", 4, "f8")


@pytest.mark.parametrize("option", [["--repeats", "0"], ["--repeats", "-1"], ["--kernel-ms", "-5"],
                                    ["--launches", "0"], ["--kernel-ms", "nan"]])
def test_bench_refuses_values_that_cannot_measure(no_gpu, option):
    """``mpsrun bench --repeats 0`` reached statistics.median([]); every non-positive value is a usage error."""
    out = subprocess.run([*MPSRUN, "bench", *option], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be a positive" in out.stderr, out.stderr


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


@pytest.mark.slow
@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.parametrize("path", PATHS)
def test_hanging_quits_are_waited_out_together_and_said_once(fake_gpu, path):
    """Two GPUs whose daemons' quit hangs, after every rank succeeded, under --timeout 9: exit 0 (--hosts exited 124,
    the job's timeout firing while the hosts tore down) and one line naming both daemons, on every path, and both
    daemons were sent quit together, as their kept logs show (they were stopped one after another, 10 s apart, each
    said in a line of its own; per-node and --hosts said nothing, their keepers' warnings went to the keepers'
    logs). Slow on purpose: a hanging quit is waited out."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    out = subprocess.run(job_argv(path, ["--gpus", "all", "--keep-logs", "--timeout", "9"], ["true"], ranks=2),
                         capture_output=True, text=True, timeout=120)
    quits = [line for line in out.stderr.splitlines() if "did not quit" in line]
    assert out.returncode == 0, out.stderr
    assert len(quits) == 1 and re.search(r"MPS control daemons \d+, \d+ did not quit in 10 s", quits[0]), out.stderr
    wait_processes_gone(fake_gpu)
    logs = [log.read_text() for root in fake_gpu.session_dirs() for log in root.glob("gpu*/log/control.log")]
    stamps = [datetime.datetime.fromisoformat(match) for log in logs
              for match in re.findall(r"\[(\S+ \S+) Control +\d+\] Cmd:quit", log)]
    for root in fake_gpu.session_dirs():
        shutil.rmtree(root)
    assert len(stamps) == 2 and abs((stamps[0] - stamps[1]).total_seconds()) < 5, logs  # (one after another: >= 10)
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_daemon_that_dies_under_the_job_is_said_once(fake_gpu, short_tmp, path):
    """The daemon SIGKILLed under a running job: exit 3 and one line saying so, on every path (per-node and --hosts
    added an 11-line block of the daemon's log after it)."""
    job = subprocess.Popen(job_argv(path, ["--grace", "1"], fake("--report-dir", str(short_tmp), "--hold", "60"),
                                    ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) == 2, 60, "the ranks did not start", proc=job)
    root = daemon_session(fake_gpu)
    daemon = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3, err
    said = [line for line in err.splitlines() if line.startswith("mpsrun") and "daemon" in line]
    assert len(said) == 1 and "died under the job" in said[0], err  # the ranks say what CUDA told them
    assert not [line for line in err.splitlines() if line.startswith("[20")], err  # no block of the daemon's log
    settle(fake_gpu)


def _with_closed(fd: int, path: str, argv: list[str]) -> tuple[list[str], object]:
    """``argv`` with descriptor ``fd`` closed in mpsrun: the command line and the preexec_fn that closes it (under a
    bare --per-node, in each rank's mpsrun, not in mpiexec, whose own closed stdout is its own affair)."""
    if path != "per-node":
        return argv, lambda: os.close(fd)
    launcher, ranks = argv[:3], argv[3:]
    return [*launcher, "sh", "-c", f'exec "$@" {fd}>&-', "sh", *ranks], None


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fd", [1, 2])
def test_a_closed_stdout_or_stderr_changes_nothing_but_the_output(fake_gpu, path, fd):
    """mpsrun started with stdout or stderr closed (``>&-``): the job runs and exits with its rank's code, with no
    traceback (Python's sys.stdout is None then: 'NoneType' object has no attribute 'flush', exit 1; under
    the mpiexec launchers mpiexec's stdout was closed for good, and Hydra failed with 255)."""
    argv, close = _with_closed(fd, path, job_argv(path, [], ["sh", "-c", "exit 6"], ranks=2))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=close)
    assert out.returncode == 6, out.stderr
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
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


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["mpiexec", "hosts"])
def test_a_reader_that_leaves_early_ends_the_job_at_once(fake_gpu, path):
    """mpsrun's output piped to a reader that takes one line (``| head -1``): mpiexec dies of SIGPIPE, and the job
    says so in one line, at once (under --hosts it took 33 s: the job's controller gave up ranks as never started
    whose starts its node keeper still relayed, and that keeper then waited 30 s for their verdicts)."""
    job = subprocess.Popen(job_argv(path, ["--tag-output"], ["seq", "1", "2000000"], ranks=2),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout is not None and job.stdout.readline().endswith("1\n")
    job.stdout.close()  # the reader is gone: the next writes fail
    _, stderr = job.communicate(timeout=25)  # less than a node keeper's wait for its verdicts
    assert job.returncode == 128 + signal.SIGPIPE, stderr
    assert [line for line in stderr.splitlines() if line.startswith("mpsrun")] == [stderr.splitlines()[0]], stderr
    assert "SIGPIPE" in stderr, stderr  # ('before rank(s) N started' is true of a rank that was slow to join)
    settle(fake_gpu)


def _node_keeper(fake_gpu) -> psutil.Process:
    """The node keeper of this fake machine's job."""
    return next(p for p in psutil.process_iter(["cmdline"]) if "mpsrun.agent.keeper" in " ".join(p.info["cmdline"] or [])
                and p.environ().get("MPSRUN_FAKE_NVML") == str(fake_gpu.nvml_dir))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_stopped_node_keeper_cannot_outlast_the_timeout(fake_gpu, short_tmp, path):
    """A node keeper stopped (SIGSTOP) while its ranks run: --timeout still ends the job, with 124 and one line,
    once the controller's own way (SIGTERM, --grace, its verdict) is overdue (it hung until killed, over 60 s). Slow
    on purpose: the supervisors give the keeper --grace and 10 s more before they act on their own. The timeout leaves
    the ranks time to start under load (with 2 s, --hosts timed out before its ranks ran, on a loaded CI machine)."""
    options = ["--timeout", "8", "--grace", "0.5"]
    job = subprocess.Popen(job_argv(path, options, fake("--hold", "60", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    keeper = _node_keeper(fake_gpu)
    keeper.suspend()
    try:
        _, err = job.communicate(timeout=60)
    finally:
        keeper.resume()  # it then finds its ranks gone and ends its session
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 124 and 1 <= len(lines) <= 2 and all("time" in line for line in lines), err
    assert "timed out after 8 s" in err, err
    settle(fake_gpu)


def _ended(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # its stopped parent has not reaped it
    return True


@pytest.mark.slow
@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_stopped_rank_supervisor_does_not_keep_its_program_past_the_timeout(fake_gpu, short_tmp, path):
    """A rank's own mpsrun stopped (SIGSTOP) under --timeout, its program ignoring SIGTERM: the program still ends
    after --grace (its controller kills its process group, not only asks its supervisor), and once the supervisor
    is continued the job ends with 124 (the program ran on until it finished by itself: 60 s here, forever for
    some). The stopped supervisor itself holds the launcher until continued, as any stopped process does."""
    report = f"os.path.join({str(short_tmp)!r}, os.environ['RANK'])"  # written whole, then named .json
    program = ("import json, os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               f"open({report} + '.tmp', 'w').write(json.dumps({{'pid': os.getpid()}})); "
               f"os.replace({report} + '.tmp', {report} + '.json'); time.sleep(60)")
    job = subprocess.Popen(job_argv(path, ["--timeout", "8", "--grace", "0.5"], [sys.executable, "-c", program],
                                    ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    programs = [json.loads(report.read_text())["pid"] for report in short_tmp.glob("*.json")]
    stopped = per_node_ranks(job)[0]
    stopped.suspend()
    try:
        wait_for(lambda: all(_ended(pid) for pid in programs), 40, "a program outlived its stopped supervisor")
    finally:
        stopped.resume()
    _, err = job.communicate(timeout=60)
    assert job.returncode == 124 and "timed out after 8 s" in err, err
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_mpiexec_options_under_per_node_are_said_to_do_nothing(fake_gpu):
    """--mpiexec-arg given to mpsrun --per-node (where the user's launcher already started the ranks) is said once
    to have no effect, as under --launcher local (it was ignored without a word)."""
    out = subprocess.run(job_argv("per-node", ["--mpiexec-arg", "-verbose"], ["true"], ranks=2), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("have no effect with --per-node") == 1, out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_a_large_environment_reaches_the_ranks(fake_gpu, path):
    """An environment of 1.5 MB (Linux allows 2 MiB by default) reaches every rank whole (local and mpiexec failed
    with exit 3 and 'the job's controller went away': the welcome, which carries it, was over a line's limit)."""
    big = {f"BIGVAR{i}": "z" * 10000 for i in range(150)}
    check = "import os; assert all(len(os.environ[f'BIGVAR{i}']) == 10000 for i in range(150))"
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", check], ranks=2), capture_output=True, text=True,
                         timeout=120, env={**os.environ, **big})
    assert out.returncode == 0, out.stderr[-2000:]
    settle(fake_gpu)


@pytest.mark.slow
@pytest.mark.parametrize("fake_gpu", [1, 2], indirect=True)
@pytest.mark.parametrize("path", ["local"])  # the path that failed (mpiexec, per-node and --hosts gave 124)
def test_a_stopped_daemon_cannot_turn_a_timeout_into_a_rank_failure(fake_gpu, short_tmp, path):
    """The MPS daemons stopped (SIGSTOP) while ranks run under --timeout, on one GPU or two: the job still ends with
    124 (the local launcher exited 1, 'rank 1 exited with code 1 first': its loop was held up by the daemon's silence
    past the deadline, and the ranks' ends came before its timer), saying the timeout once and the silence once. No
    more commands go to a daemon that left one unanswered (each waited out its own 10 s: the job took 32 s, with 4
    lines); the watch's commands, in the controller's loop, wait 2 s (with two GPUs they held the loop past the
    ranks' supervisors' backstop, and the timeout was said twice). Slow on purpose: the first unanswered command
    waits out its deadline. The timeout leaves the ranks time to start under load; the fake ranks' kernels run on, as
    a real rank's do on its server, which the daemon's stop does not stop."""
    job = subprocess.Popen(job_argv(path, ["--timeout", "8", "--grace", "0.5", "--gpus", "all"],
                                    fake("--hold", "30", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    daemons = [p for p in descendants(job, "nvidia-cuda-mps-control") if p.cmdline()[-1] == "-f"]
    for daemon in daemons:
        daemon.suspend()
    try:
        _, err = job.communicate(timeout=120)
    finally:
        for daemon in daemons:
            with contextlib.suppress(psutil.Error):
                daemon.resume()
    lines = [line for line in err.splitlines() if line.startswith("mpsrun")]
    assert job.returncode == 124 and len(daemons) == len(fake_gpu.uuids), err
    assert "timed out after 8 s" in err and "first" not in err and "supervisors did" not in err, err
    assert err.count("timed out after") == 1 and err.count("stopped answering") <= 1, err
    assert len(lines) <= 3 and "did not quit" not in err, err  # its silence is said once, not again at its quit
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_a_ctrl_c_to_the_group_does_not_cut_the_daemons_quit(fake_gpu, path):
    """A Ctrl-C reaches a terminal's whole foreground group. One that came while mpsrun's ``quit`` command ran killed
    that command before the daemon had it: the teardown then waited out its 10 s and terminated the daemon. The
    control commands now run in a session of their own: the job ends with 130 and one line, at once. (Under
    --per-node and --hosts the commands come from the node keepers, which had sessions of their own already.)"""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_CLIENT_WAIT="4")  # (the Ctrl-C must come while it runs)
    job = subprocess.Popen(job_argv(path, ["-v"], ["true"], ranks=2), stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own group, as a terminal's foreground job
    output = Output(job.stderr)
    output.wait_for("mpsrun: ranks done", 60, proc=job)  # the teardown's commands from here on: quit

    def quit_client() -> bool:
        with contextlib.suppress(psutil.Error):
            return any(not {"-f", "--server"} & set(p.cmdline()) for p in descendants(job, "nvidia-cuda-mps-control"))
        return False

    wait_for(quit_client, 60, "no quit command ran", proc=job)
    os.killpg(job.pid, signal.SIGINT)
    job.wait(timeout=60)
    err = output.text()
    assert job.returncode == 130, err
    assert "did not quit" not in err and "interrupted by SIGINT while ending the job" in err, err
    settle(fake_gpu)


def test_hosts_slow_to_resolve_are_looked_up_only_until_the_timeout(monkeypatch):
    """Names that each take a resolver's time (unreachable DNS): the controller stops looking them up when the job's
    --timeout has passed, and listens on every interface (the timeout then ends the job). A host file of 100 such
    names under --timeout 3 took 22 s, 3,000 more than 40 s, before the job's clock could say a word (fourth
    hostile pass)."""
    import time

    from mpsrun.job import hosts
    from mpsrun.runtime.deadline import Deadline

    looked_up = []

    def slow(host, *args, **kwargs):
        looked_up.append(host)
        time.sleep(0.1)
        raise OSError("no resolver")

    monkeypatch.setattr(hosts.socket, "getaddrinfo", slow)
    assert hosts.listen_address([f"h{i}" for i in range(100)], Deadline(0.5)) == ""
    assert 0 < len(looked_up) <= 6, looked_up  # (a loaded machine sleeps longer: fewer)


def test_a_hosts_controller_listens_on_the_address_its_hosts_reach(fake_gpu):
    """The --hosts controller listens where its hosts reach it, not on every interface: over loopback for
    ``--hosts localhost`` (its per-node ranks are told 127.0.0.1). Only hosts that resolve to nothing (the launcher
    then says why) leave it on every interface. tests/test_two_hosts.py checks the same across two hosts."""
    from mpsrun.job.hosts import listen_address
    from mpsrun.runtime.deadline import Deadline

    assert listen_address(["localhost"], Deadline(None)) == "127.0.0.1"
    assert listen_address(["no-such-host.invalid"], Deadline(None)) == listen_address([], Deadline(None)) == ""
    job = subprocess.Popen(job_argv("hosts", [], fake("--hold", "1"), ranks=2), stderr=subprocess.PIPE, text=True)
    host, port = _control_port(job)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0 and (host, port > 0) == ("127.0.0.1", True), err
    settle(fake_gpu)
