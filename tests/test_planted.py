"""What a rank can plant (issue 49): every rank knows MPSRUN_SESSION_DIR, so it can make FIFOs, links to /dev/zero,
device nodes and files of any size anywhere in its user's session root. Whatever it plants, no later command of the
user waits past its deadline, reads without bound, or ends in a traceback. With the fake GPU; every command runs with
a timeout and under a memory limit, so a regression fails here instead of hanging the suite."""

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPSRUN, job_argv, mpiexec, settle

pytestmark = pytest.mark.mpiexec

_MPS_SESSION = "from mpsrun import mps_session\nwith mps_session(gpu=0):\n    pass\n"

#: Each command a user runs after a rank planted something, with what it must exit with.
COMMANDS = {
    "job": ([*MPSRUN, "--timeout", "10", "-np", "1", "--launcher", "local", "true"], 0),
    "mps_session": ([sys.executable, "-c", _MPS_SESSION], 0),
    "status": ([*MPSRUN, "status"], 0),
    "status --json": ([*MPSRUN, "status", "--json"], 0),
    "top --once": ([*MPSRUN, "top", "--once"], 0),
    "top --json": ([*MPSRUN, "top", "--json"], 0),
    "cleanup": ([*MPSRUN, "cleanup"], 0),
}


def limited_memory() -> None:
    """In the child: a read without bound fails at 2 GiB instead of eating the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def bounded(argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    """``argv`` to its end, or the test fails (it would have hung): its output as text."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=limited_memory,
                              **kwargs)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv)[-200:]} still ran after {timeout} s", pytrace=False)


def plant(where: Path, name: str) -> list[str]:
    """At ``where/name``: a FIFO in ``fifo/``, a link to /dev/zero in ``link/`` and, where this user may make one,
    a device node (/dev/zero's) in ``node/``; the directories made, as a rank makes them (the FIFO is met first)."""
    kinds = ["fifo", "link", "node"]
    where.mkdir(mode=0o700, exist_ok=True)
    for kind in kinds:
        (where / kind).mkdir(mode=0o700)
    os.mkfifo(where / "fifo" / name)
    os.symlink("/dev/zero", where / "link" / name)
    try:
        os.mknod(where / "node" / name, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except OSError:  # not root, or a file system mounted nodev
        shutil.rmtree(where / "node")
        kinds.remove("node")
    return kinds


@pytest.mark.parametrize("command", COMMANDS)
def test_a_record_planted_under_the_session_root_stops_no_command(fake_gpu, command):
    """A FIFO, a link to /dev/zero and a device node, each as session.json of a directory under the user's session
    root (where a rank makes them in one line): every later command (a job, mps_session(), status, top, cleanup) ends
    with its own exit code, no traceback and no runaway read. SessionRecord.read opened the FIFO and waited for ever
    (the job before its --timeout existed, and cleanup, the remedy, too), and read /dev/zero until memory ran out."""
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    kinds = plant(root, "session.json")
    try:
        argv, code = COMMANDS[command]
        out = bounded(argv)
        listed = json.loads(out.stdout) if command == "status --json" else None
    finally:
        for kind in kinds:
            shutil.rmtree(root / kind)
    assert out.returncode == code and "Traceback" not in out.stderr, (out.returncode, out.stderr[-2000:])
    if listed is not None:  # each named once, as a session that cannot be read
        assert sorted(s["session"] for s in listed if s["problem"]) == sorted(kinds), listed
        assert all("not a regular file" in s["problem"] for s in listed), listed
    settle(fake_gpu)


def test_a_fifo_planted_at_the_records_old_temporary_name_stops_no_job(fake_gpu, short_tmp):
    """A FIFO at $MPSRUN_SESSION_DIR/session.json.tmp, the fixed name the record was written through, planted before
    the ranks start (here by the job's mpiexec, a wrapper that plants it and then runs the real one; a rank of a large
    job does the same): the record's next write (the ranks' start) must not wait on it. mpsrun blocked in the FIFO's
    open, past --timeout and SIGTERM; the job must end as it would have (exit 0), its directory removed."""
    wrapper = short_tmp / "mpiexec"
    wrapper.write_text(f"#!{sys.executable}\nimport os, sys\n"
                       "os.mkfifo(os.path.join(os.path.dirname(os.environ['MPSRUN_CONTROL'].partition(':')[2]), 'session.json.tmp'))\n"
                       f"os.execv({mpiexec()!r}, [{mpiexec()!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o700)
    out = bounded([*MPSRUN, "--timeout", "20", "-np", "2", "--launcher", "mpiexec", "--mpiexec", str(wrapper),
                   "true"], timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-2000:])
    settle(fake_gpu)


def _node_session_of(fake_gpu, job: str) -> Path:
    """Where a bare --per-node job whose MPSRUN_JOB_ID is ``job`` keeps this machine's node session (a name anyone
    can work out: the host's and the job's)."""
    from mpsrun.agent.pernode import node_session_name
    from mpsrun.session.paths import make_user_root

    return make_user_root(fake_gpu.tmpdir) / node_session_name({"MPSRUN_JOB_ID": job})


def _plant(where: Path, what: str) -> None:
    if what == "fifo":
        os.mkfifo(where)
    elif what == "file":
        where.write_text("x")
    elif what == "link":
        where.symlink_to("/dev/zero")
    else:
        where.mkdir(0o700)
        if what == "directory with a fifo as its reservation":
            os.mkfifo(where / "reserved")


@pytest.mark.parametrize("what", ["fifo", "file", "link", "empty directory", "directory with a fifo as its reservation"])
def test_what_is_planted_at_a_node_sessions_name_holds_no_job(fake_gpu, monkeypatch, what):
    """Something planted where a --per-node job's node session will be (no keeper's: no record and no reservation of
    regular files): the job starts at once and ends 0, and what was planted is gone. The ranks waited 60 s, past
    --timeout, and the job then ended 0 without a word (third hostile pass)."""
    monkeypatch.setenv("MPSRUN_JOB_ID", "planted")
    where = _node_session_of(fake_gpu, "planted")
    _plant(where, what)
    out = subprocess.run(job_argv("per-node", ["--timeout", "10"], ["true"], ranks=2), capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert not os.path.lexists(where) and not list(where.parent.iterdir())
    settle(fake_gpu)


def test_a_node_sessions_name_held_by_a_live_reservation_is_waited_for_until_the_timeout(fake_gpu, monkeypatch):
    """A reservation that looks alive (a regular file, new) at a --per-node job's node session: the ranks wait for
    it until --timeout, not past it, and the node's local rank 0 says so once, naming the directory: exit 124 (they
    waited 60 s, then ran; with the file touched, 120 s, and each rank said it)."""
    monkeypatch.setenv("MPSRUN_JOB_ID", "held")
    where = _node_session_of(fake_gpu, "held")
    where.mkdir(0o700)
    (where / "reserved").write_text("0123456789abcdef")
    try:
        out = subprocess.run(job_argv("per-node", ["--timeout", "2"], ["true"], ranks=2), capture_output=True,
                             text=True, timeout=50)
    finally:
        shutil.rmtree(where)
    assert out.returncode == 124, out.stderr
    assert out.stderr.splitlines() == [f"mpsrun: error: timed out after 2 s while this node's session started: "
                                       f"{where} looks in use (a live keeper's record, or a reservation of the last "
                                       "minute)"], out.stderr
    settle(fake_gpu)


def test_a_file_larger_than_its_bound_is_not_read(tmp_path):
    """read_file reads a regular file whole up to its bound, and refuses a larger one (EFBIG) rather than read a part
    or all of it: a rank can make its session's record as large as the disk allows."""
    from mpsrun.runtime.files import read_file

    (tmp_path / "small").write_bytes(b"x" * 10)
    (tmp_path / "large").write_bytes(b"x" * 11)
    with pytest.raises(OSError, match="larger than 10 bytes"):
        read_file(tmp_path / "large", 10)
    assert read_file(tmp_path / "small", 10) == b"x" * 10


def test_a_write_replaces_what_was_planted_at_its_name(tmp_path):
    """replace_file puts a new file at a name where a FIFO or a link was planted, never opening the FIFO (which would
    wait for a reader) nor writing through the link, and leaves no temporary file beside it."""
    from mpsrun.runtime.files import replace_file

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "elsewhere").write_text("kept")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    for name in ("fifo", "link"):
        replace_file(tmp_path / name, b"new")
        assert (tmp_path / name).read_bytes() == b"new" and not (tmp_path / name).is_symlink()
    assert (tmp_path / "elsewhere").read_text() == "kept" and sorted(os.listdir(tmp_path)) == ["elsewhere", "fifo",
                                                                                               "link"]


def stale_record(fake_gpu, name: str, daemons: list[int] = (), ranks: list[int] = (), argv: list[str] = ()) -> Path:
    """A session directory ``name`` whose record, as a rank can write one, has an owner that is gone and names the
    processes ``daemons`` and ``ranks`` (pids) as its daemons and rank groups."""
    from mpsrun.runtime.processes import ProcessRef

    session = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}" / name
    session.parent.mkdir(mode=0o700, exist_ok=True)
    session.mkdir(mode=0o700)
    record = {"kind": "job", "owner": {"pid": 1 << 30, "start": 1}, "uid": os.getuid(), "started": 0, "argv": argv,
              "daemons": [{"gpu": fake_gpu.uuids[0], "process": ProcessRef.of(pid)._asdict(),
                           "pipe_dir": str(session / "gpu0" / "pipe"), "log_dir": str(session / "gpu0" / "log")}
                          for pid in daemons],
              "ranks": [ProcessRef.of(pid)._asdict() for pid in ranks]}
    (session / "session.json").write_text(json.dumps(record))
    return session


@pytest.mark.skipif(os.getuid() != 0, reason="a process of another user is made as root")
def test_cleanup_never_stops_another_users_process_a_record_names(fake_gpu):
    """A stale record (a rank can write one) naming another user's processes as its daemon and its rank group:
    cleanup removes the session, stops neither process, and says `0 daemon(s) stopped`. Run as root, it SIGTERMed
    the other user's process group and said `1 daemon(s) stopped` (it counted every live daemon it tried)."""
    def as_another_user() -> None:
        os.setgid(65533)
        os.setuid(65533)

    others = [subprocess.Popen(["sleep", "60"], preexec_fn=as_another_user, start_new_session=True) for _ in range(2)]
    try:
        stale_record(fake_gpu, "sother", daemons=[others[0].pid], ranks=[others[1].pid])
        out = bounded([*MPSRUN, "cleanup"])
        alive = [process.poll() is None for process in others]
    finally:
        for process in others:
            process.kill()
            process.wait()
    assert out.returncode == 0 and out.stdout.startswith("sother: removed (owner"), out
    assert "0 daemon(s) stopped" in out.stdout and alive == [True, True], (out.stdout, alive)
    settle(fake_gpu)


def test_cleanup_prints_a_planted_sessions_name_escaped(fake_gpu):
    """A stale session directory whose name holds an escape sequence (a rank can make one in its user's session
    root): cleanup removes it and names it escaped, never raw."""
    stale_record(fake_gpu, "s\x1b]0;PWNED\x07")
    out = bounded([*MPSRUN, "cleanup"])
    assert out.returncode == 0 and out.stdout.startswith("'s\\x1b]0;PWNED\\x07': removed"), out
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    settle(fake_gpu)


def test_directories_without_a_record_cost_one_scan_of_the_processes(fake_gpu, monkeypatch):
    """Directories without a record, older than a session takes to be made, are stale unless a process of the user
    uses them (its MPS pipe directory or MPSRUN_SESSION_DIR lies in one). Listing them scans the process table once,
    not once per directory and question (a rank can make thousands: 300 took status 28 s, a job 36 s past its
    --timeout 5), and a path that merely begins with a directory's name (sab, for sa) does not keep it."""
    import psutil

    from mpsrun.session import registry

    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    root.mkdir(mode=0o700)
    for name in ("sa", "sab"):
        (root / name).mkdir(mode=0o700)
        os.utime(root / name, (1, 1))
    user = subprocess.Popen(["sleep", "60"], env={**os.environ, "MPSRUN_SESSION_DIR": str(root / "sab")})
    scans = []
    real = psutil.process_iter
    monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: scans.append(1) or real(*a, **k))
    try:
        states = {state.session_id: state for state in registry.list_sessions(fake_gpu.tmpdir)}
        stale = {name: (state.stale, state.stale, state.kept) for name, state in states.items()}
    finally:
        user.kill()
        user.wait()
        for name in ("sa", "sab"):
            (root / name).rmdir()
    assert stale == {"sa": (True, True, False), "sab": (False, False, False)} and len(scans) == 1, (stale, scans)


def _pretending(session: Path, answers: bool) -> subprocess.Popen:
    """A process of this user that a planted record names as a daemon: ``answers``: with the record's pipe directory
    in its environment (as mpsrun starts a daemon), ignoring SIGTERM (as a daemon that will not stop)."""
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    env = {**os.environ, **({"CUDA_MPS_PIPE_DIRECTORY": str(session / "gpu0" / "pipe")} if answers else {})}
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)


@pytest.mark.parametrize("named", ["any process", "a daemon that will not stop"])
def test_records_naming_processes_as_daemons_do_not_hold_a_job_past_its_timeout(fake_gpu, named):
    """Five stale records (a rank can write them) naming a live process of the user as their daemon: a new job
    spends at most a second on what earlier runs left before it starts, so it ends well within --timeout (exit 0),
    and a process that was never a daemon of the record (no such pipe directory in its environment) is not signalled.
    Each such record cost the job a quit's timeout and two graces (20 took 3 minutes under --timeout 5), and the job's
    start signalled whatever process the record named."""
    sessions = [stale_record(fake_gpu, f"sdaemon{i}") for i in range(5)]
    processes = [_pretending(session, named != "any process") for session in sessions]
    try:
        for session, process in zip(sessions, processes, strict=True):
            stale_record_daemon(session, process.pid)
        out = bounded([*MPSRUN, "--timeout", "20", "-np", "1", "--launcher", "local", "true"], timeout=60)
        untouched = [process.poll() is None for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for session in sessions:
            shutil.rmtree(session, ignore_errors=True)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    if named == "any process":
        assert all(untouched), untouched
    settle(fake_gpu)


def test_status_and_a_dry_run_cut_what_would_stretch_a_line(fake_gpu):
    """A record naming 3,000 daemons (a rank can write one) and a command of 120,000 characters: `mpsrun status`
    and `--dry-run` keep every line within a line of ours (status printed 39 kB in one row, 2.8 MB for 200,000
    daemons; the dry run the whole command; fourth hostile pass)."""
    from mpsrun.runtime.output import LINE_MOST

    session = stale_record(fake_gpu, "smany", daemons=[os.getpid()] * 3000)
    try:
        status = bounded([*MPSRUN, "status"], timeout=60)
    finally:
        shutil.rmtree(session)
    dry = bounded([*MPSRUN, "-np", "2", "--dry-run", "true", "N" * 120_000], timeout=60)
    for out in (status, dry):
        assert out.returncode == 0 and max(map(len, out.stdout.splitlines())) <= LINE_MOST, out.stdout[:2000]
    assert "smany" in status.stdout and "..." in status.stdout


def stale_record_daemon(session: Path, pid: int) -> None:
    """Name process ``pid`` as the daemon of the stale record at ``session``."""
    from mpsrun.runtime.processes import ProcessRef

    record = json.loads((session / "session.json").read_text())
    record["daemons"] = [{"gpu": "GPU-0", "process": ProcessRef.of(pid)._asdict(),
                          "pipe_dir": str(session / "gpu0" / "pipe"), "log_dir": str(session / "gpu0" / "log")}]
    (session / "session.json").write_text(json.dumps(record))


def test_a_fifo_planted_as_the_output_lock_keeps_no_supervisor_waiting(short_tmp):
    """A rank can replace its session's output.lock (which the local launcher's supervisors open as they start their
    ranks) with a FIFO: a supervisor opens it without waiting for a writer. Supervisors that started after rank 0
    planted one (-np 150) waited in the open for ever, and the job ran into its --timeout, 15 s past it."""
    os.mkfifo(short_tmp / "output.lock")
    code = "import sys\nfrom mpsrun.runtime.output import _open_lock\nprint(_open_lock(sys.argv[1]) is not None)\n"
    out = bounded([sys.executable, "-c", code, str(short_tmp / "output.lock")], timeout=30)
    assert out.returncode == 0 and out.stdout == "True\n", out


_DEEP_TREE = ("import os\nfd = os.open(os.environ['MPSRUN_SESSION_DIR'], os.O_RDONLY)\nfor _ in range(3000):\n"
              "    os.mkdir('d', dir_fd=fd)\n    deeper = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
              "    os.close(fd)\n    fd = deeper\n")


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_deep_directory_tree_planted_in_the_session_is_removed(fake_gpu, launcher):
    """A rank makes a directory tree 3000 levels deep in $MPSRUN_SESSION_DIR (a loop of mkdir, one line): the job
    still ends with the rank's code (0), with no traceback, and its directory is removed. shutil.rmtree recursed once
    per level: the teardown ended in a RecursionError traceback, exit 1, and left the renamed directory
    (`sXXXX-goneYYYY`) behind, which `mpsrun cleanup` then said there was nothing to clean up of."""
    try:
        out = bounded(job_argv(launcher, ["--timeout", "30"], [sys.executable, "-c", _DEEP_TREE], ranks=1), timeout=60)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-1500:])
        settle(fake_gpu)
        assert not fake_gpu.session_dirs(), fake_gpu.session_dirs()
    finally:  # what a failure left: rm, which removes a tree of any depth (the fixture's rmtree recurses too)
        for left in fake_gpu.session_dirs():
            subprocess.run(["rm", "-rf", "--", str(left)], check=False)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_full_device_as_standard_output_is_said_once_per_rank(fake_gpu, launcher):
    """mpsrun's stdout is /dev/full (every write: ENOSPC): no traceback; each rank whose output could not be passed
    on is named once with the cause (the rest of its output is dropped, and it would get EPIPE writing more), and the
    job's code is its ranks' (0). Under the mpiexec launcher each supervisor printed an OSError traceback (exit 1);
    under the local launcher each said `a rank's supervisor could not run` and a summary followed (exit 3)."""
    with open("/dev/full", "wb") as full:
        out = subprocess.run(job_argv(launcher, ["--timeout", "30"], [sys.executable, "-c", "print('x')"], ranks=2),
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    said = sorted(out.stderr.splitlines())
    assert out.returncode == 0 and said == [f"mpsrun: rank {rank}: its output could not be passed on (No space left "
                                            "on device); the rest is dropped" for rank in (0, 1)], out.stderr[-1500:]
    settle(fake_gpu)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_command_not_found_is_named_escaped(fake_gpu, launcher):
    """A command whose name holds an escape sequence and a newline is not found: exit 127 and one line on stderr
    with the name escaped (as cleanup and top print what a rank controls). The name was printed raw: the terminal
    took the escape, and the message ran over two lines."""
    out = bounded(job_argv(launcher, ["--timeout", "30"], ["\x1b[31mno\nsuch\x07"], ranks=2))
    assert out.returncode == 127, (out.returncode, out.stderr)
    assert "\x1b" not in out.stderr and "\x07" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_ranks_exception_text_reaches_the_summary_escaped(fake_gpu, launcher):
    """A Python rank using mpi4py dies of an exception whose text holds escape sequences (a colour, a window title, a bell) and a
    newline: mpsrun's summary names it with each control character escaped, on one line. The summary printed the
    rank's text raw (the terminal took the escapes); only the rank's own traceback, its output, still holds them."""
    code = "from mpi4py import MPI\nraise ValueError('\\x1b[31mRED\\x1b]0;T\\x07\\nnext')"
    out = bounded(job_argv(launcher, ["--timeout", "30"], [sys.executable, "-c", code], ranks=2))
    ours = [line for line in out.stderr.splitlines() if line.startswith("mpsrun:")]
    summary = [line for line in ours if "first" in line]
    assert out.returncode == 1 and len(summary) == 1 and "\\x1b[31mRED" in summary[0], out.stderr
    assert all(line.isprintable() for line in ours), ours
    settle(fake_gpu)


_FORGER = """import glob, os, socket, sys, time
here, flags = os.environ['MPSRUN_SESSION_DIR'], sys.argv[1]
if os.environ['RANK'] == '0':
    deadline = time.monotonic() + 30
    while not (found := glob.glob(os.path.join(here, 'abort.1.*'))) and time.monotonic() < deadline:
        time.sleep(0.01)
    with socket.socket(socket.AF_UNIX) as forged:
        try:  # the supervisor may drop the connection at once
            forged.connect(found[0])
            forged.sendall(b'7 forged word\\n')
            time.sleep(0.5)
        except OSError:
            pass
    open(os.path.join(flags, 'sent'), 'w').close()
else:
    while not os.path.exists(os.path.join(flags, 'sent')):
        time.sleep(0.01)
"""


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_rank_cannot_speak_for_another_ranks_end(fake_gpu, short_tmp, launcher):
    """Rank 0 connects to the socket where rank 1's runner would say how rank 1 ends before an MPI_Abort (it lies in
    the session directory, which every rank can reach) and says 'exit 7': rank 1's supervisor only hears its own
    rank's processes, so the job ends with its ranks' code, 0, and the forged word is nowhere. Before, the job exited
    7 naming rank 1 with the forged words (and a silent connection held rank 1's supervisor for 10 s)."""
    out = bounded(job_argv(launcher, ["--timeout", "60"], [sys.executable, "-c", _FORGER, str(short_tmp)], ranks=2),
                  timeout=90)
    assert out.returncode == 0 and "forged" not in out.stderr, (out.returncode, out.stderr[-1500:])
    settle(fake_gpu)


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_removed_daemon_socket_is_not_waited_on(fake_gpu, launcher):
    """A rank removes its MPS control daemon's socket (the pipe directory is the rank's to reach): the job still
    ends with its ranks' code, and the daemon, which `quit` cannot reach, is ended at once and said so in one line.
    Before, its teardown waited out the whole quit timeout (10 s) for a `quit` that had failed at once, and said the
    daemon 'did not quit in 10 s'."""
    code = "import os\nos.unlink(os.path.join(os.environ['CUDA_MPS_PIPE_DIRECTORY'], 'control'))\n"
    out = bounded(job_argv(launcher, ["--timeout", "60", "--mps", "on"], [sys.executable, "-c", code], ranks=1),
                  timeout=90)
    quits = [line for line in out.stderr.splitlines() if "quit" in line]
    assert out.returncode == 0 and len(quits) == 1 and re.search(r"MPS control daemon \d+ did not take quit \(.+\); "
                                                                 "terminated", quits[0]), out.stderr[-1500:]
    settle(fake_gpu)


_REMOVE = "import sys\nfrom mpsrun.runtime.files import remove_tree\nremove_tree(sys.argv[1])\n"


def _without_mode_override(argv: list[str]) -> list[str]:
    """``argv`` as an ordinary user runs it: root without the capabilities that override file modes."""
    if os.getuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: cannot drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", *argv]


def test_a_read_only_directory_in_a_session_is_removed(tmp_path: Path):
    """A directory a rank made read-only (mode 0555, as Go's module cache and `cp -a` of a read-only tree make them),
    holding a file and a subdirectory, is removed with the rest of the session by an ordinary user: nothing is left
    and nothing is raised. The teardown failed with 'Permission denied' (exit 3) and left the directory (found by the
    second hostile pass)."""
    session = tmp_path / "s"
    (session / "ro" / "sub").mkdir(parents=True)
    (session / "ro" / "f").write_text("x")
    (session / "ro").chmod(0o555)
    session.chmod(0o555)  # and the session's own directory
    try:
        done = subprocess.run(_without_mode_override([sys.executable, "-c", _REMOVE, str(session)]),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not session.exists(), done.stderr
    finally:
        for directory in (session, session / "ro"):
            with contextlib.suppress(OSError):
                directory.chmod(0o755)


@pytest.mark.parametrize("modes", [{"gpu0": 0o700, "gpu0/log": 0o500}, {"x": 0o000, "x/y": 0o000},
                                   {"gpu0": 0o500, "gpu0/log": 0o000}, {".": 0o000}])
def test_a_directory_a_rank_locked_deep_in_a_session_is_removed(tmp_path: Path, modes):
    """Directories a rank made unwritable or unreadable below the session's top (``chmod 0500 gpu0/log``, ``chmod
    000 x/y x``), or the top itself unreadable, are removed by an ordinary user: moving such a directory up rewrites
    its '..', which its mode refused ('[Errno 13] Permission denied: 'log' -> '.e888...'', exit 3, the session left),
    and the top was opened without a way round its mode (third and fourth hostile passes)."""
    session = tmp_path / "s"
    for name in modes:
        (session / name).mkdir(parents=True, exist_ok=True)
        (session / name / "f").write_text("x")
    for name in sorted(modes, key=len, reverse=True):
        (session / name).chmod(modes[name])
    try:
        done = subprocess.run(_without_mode_override([sys.executable, "-c", _REMOVE, str(session)]),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not session.exists(), done.stderr
    finally:
        for name in modes:
            with contextlib.suppress(OSError):
                (session / name).chmod(0o755)


_LEFT_BESIDE_MOUNTS = """
import json, os, subprocess, sys
outside, session = sys.argv[1], sys.argv[2]
for mount in ("b", "n/m/b"):
    subprocess.run(["mount", "--bind", outside, os.path.join(session, mount)], check=True)
from mpsrun.runtime.files import remove_tree
try:
    remove_tree(session)
except OSError as exc:
    print(exc)
mounts = {line.split()[4] for line in open("/proc/self/mountinfo")}  # (a bind mount of the same file system
left = []                                                             # is no mount to os.path.ismount)
for root, dirs, files in os.walk(os.path.dirname(session)):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in mounts and os.path.join(root, d) != outside]
    left += [os.path.join(root, name) for name in files if root != os.path.dirname(session)]
print(json.dumps(left))
"""


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_bind_mount_in_a_session_is_not_entered(tmp_path: Path):
    """A directory outside the session bind-mounted onto ones inside it (a root rank, in mpsrun's own mount
    namespace), at the top and deeper down, is never entered: the removal fails on it with one reason, nothing outside
    the session is touched, and everything else in the session goes. It was entered and a file outside deleted
    (second hostile pass); then the removal stopped at the first mount point, leaving the daemon's files and logs
    beside it (fifth pass). Run in a private mount namespace of the test's own, which ends with it."""
    outside, session = tmp_path / "outside", tmp_path / "s"
    outside.mkdir()
    (outside / "sentinel").write_text("keep")
    for name in ("a/b", "b", "c/d/e", "n/m/b", "n/z/y"):
        (session / name).mkdir(parents=True)
    for name in ("a/file", "a/b/file", "c/d/e/file", "n/m/file", "n/z/y/file", "top-file", "zz"):
        (session / name).write_text("x")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", _LEFT_BESIDE_MOUNTS,
                           str(outside), str(session)], capture_output=True, text=True, timeout=60)
    assert (outside / "sentinel").read_text() == "keep", done
    assert "a mount point, not entered" in done.stdout and f"in {tmp_path}/." in done.stdout, done  # (where it is)
    assert done.stdout.splitlines()[-1] == "[]", done  # no file left but under the mount points


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_session_directory_that_is_a_mount_point_is_not_entered(tmp_path: Path):
    """A directory outside the sessions bind-mounted at a session's own name (where a --per-node job's node session
    will be, or a stale session's place): its removal fails with one reason, and the directory outside keeps its
    files and its mode. They were deleted and its mode set to 0700 (fourth hostile pass)."""
    outside, session = tmp_path / "outside", tmp_path / "s"
    outside.mkdir(mode=0o755)
    (outside / "sentinel").write_text("keep")
    session.mkdir()
    code = ("import subprocess, sys\nsubprocess.run(['mount', '--bind', sys.argv[1], sys.argv[2]], check=True)\n"
            "from mpsrun.runtime.files import remove_tree\ntry:\n    remove_tree(sys.argv[2])\nexcept OSError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code, str(outside),
                           str(session)], capture_output=True, text=True, timeout=60)
    assert (outside / "sentinel").read_text() == "keep" and stat.S_IMODE(outside.stat().st_mode) == 0o755, done
    assert "a mount point, not entered" in done.stdout, done


_HOLDER = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
           "open(sys.argv[2], 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
_HELD_LOCK_RANK = (
    "import os, subprocess, sys, time\nflags = sys.argv[1]\nheld = os.path.join(flags, 'holder')\n"
    "if os.environ['RANK'] == '0':\n"
    "    lock = os.path.join(os.environ['MPSRUN_SESSION_DIR'], 'output.lock')\n"
    f"    subprocess.Popen([sys.executable, '-c', {_HOLDER!r}, lock, held], start_new_session=True)\n"
    "while not os.path.exists(held) or not open(held).read():\n    time.sleep(0.01)\n"
    "for i in range(3):\n    print('rank', os.environ['RANK'], 'line', i, flush=True)\n")


@pytest.mark.parametrize("path", ["local", "mpiexec", "hosts"])
def test_an_output_lock_held_by_a_process_outside_the_job_holds_no_output(fake_gpu, tmp_path, path):
    """A rank leaves a process outside its group that holds the ranks' output lock (the session's output.lock) and
    writes nothing: each supervisor gives the lock up once it has been held a while with room in the output, and
    writes its lines without it, saying so once. Before, every supervisor waited on the lock with no end: the job
    ended at its --timeout (4 times over), and every line was lost."""
    try:
        out = subprocess.run(job_argv(path, ["--timeout", "60"], [sys.executable, "-c", _HELD_LOCK_RANK,
                                                                  str(tmp_path)]),
                             capture_output=True, text=True, timeout=120)
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "holder").read_text()), 9)  # the holder the test's rank left running
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(f"rank {r} line {i}" for r in range(3) for i in range(3))
    said = [line for line in out.stderr.splitlines() if "output lock was held" in line]
    assert 1 <= len(said) <= 3 and all(line.startswith("mpsrun: rank ") for line in said), out.stderr
    settle(fake_gpu)
