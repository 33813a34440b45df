"""``mpsrun top`` (issue 38): this user's running jobs on this node, a row per rank and per GPU, read from the
sessions' records, the ranks' environments, psutil and NVML; it never changes a job. With the fake GPU, whose NVML
lists each client's memory as the H100's did."""

import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MPSRUN, PATHS, fake, job_argv, settle, wait_for

pytestmark = pytest.mark.mpiexec

CONTEXT_MIB = 518
HELD = (100, 300, 700)


def _top(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*MPSRUN, "top", *args], capture_output=True, text=True, timeout=60, **kwargs)


def _snapshot() -> dict:
    out = _top("--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _running(path: str, short_tmp, options: tuple[str, ...] = ()) -> subprocess.Popen:
    """A job of three fake ranks that hold 100, 300 and 700 MiB until a file exists."""
    program = fake("--hold", "0", "--until-file", str(short_tmp / "go"), "--alloc", ",".join(map(str, HELD)))
    return subprocess.Popen(job_argv(path, list(options), program), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _end(job: subprocess.Popen, short_tmp) -> tuple[str, str]:
    (short_tmp / "go").touch()
    return job.communicate(timeout=120)


def _ranks_seen(count: int) -> dict:
    def seen() -> dict | None:
        snapshot = _snapshot()
        ranks = [r for r in snapshot["ranks"] if r["memory"] is not None]
        return snapshot if len(ranks) == count and all(r["peak"] for r in ranks) else None

    return wait_for(seen, timeout=60, what="the ranks in mpsrun top")


@pytest.mark.parametrize("path", PATHS)
def test_top_shows_each_rank_with_its_memory_limits_and_gpu(fake_gpu, short_tmp, path):
    """A running job's three ranks: their rank, pid, GPU 0, MPS client, device memory now and at its peak (the
    allocation plus the context), limit and thread percentage as mpsrun gave them, CPU and state; the GPU's row
    counts the three clients; the job ends as it would have without top."""
    job = _running(path, short_tmp, ("--mem-limit", "2G", "--thread-percentage", "50"))
    try:
        snapshot = _ranks_seen(3)
    finally:
        out, err = _end(job, short_tmp)
    assert job.returncode == 0, err
    ranks = snapshot["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for row, held in zip(ranks, HELD, strict=True):
        assert row["memory"] == held + CONTEXT_MIB and row["peak"] >= row["memory"], row
        assert (row["gpu"], row["mps"], row["limit"], row["threads"]) == (0, True, "2G", 50), row
        assert row["pid"] > 0 and row["state"] and row["running"] >= 0 and row["resident"] > 0
    assert len(snapshot["jobs"]) >= 1 and snapshot["gpus"][0]["clients"] == 3
    settle(fake_gpu)


def test_top_once_prints_a_table_and_job_picks_one(fake_gpu, short_tmp):
    """--once prints the jobs, a row per rank and a row per GPU; JOB (the session or its owner's pid) picks one job,
    and one that is not running is a usage error with one line."""
    job = _running("local", short_tmp)
    try:
        snapshot = _ranks_seen(3)
        session = snapshot["ranks"][0]["job"]
        owner = next(j["owner"] for j in snapshot["jobs"] if j["session"] == session)
        once = _top("--once", str(owner))
        absent = _top("--once", "no-such-job")
    finally:
        _end(job, short_tmp)
    assert once.returncode == 0, once.stderr
    lines = once.stdout.splitlines()
    assert lines[0].startswith("mpsrun top") and "1 job(s), 3 rank(s)" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] == [session]]
    assert [row[1] for row in rows] == ["0", "1", "2"] and all(row[5] == "yes" for row in rows)
    assert any(line.split()[:1] == ["GPU"] for line in lines)
    assert absent.returncode == 2 and absent.stderr.count("\n") == 1 and absent.stdout == ""
    settle(fake_gpu)


def test_top_without_a_terminal_prints_snapshots_until_interrupted(fake_gpu, short_tmp):
    """Piped, top prints a table every interval; Ctrl-C (SIGINT) ends it with 0 and no traceback."""
    proc = subprocess.Popen([*MPSRUN, "top", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    headers = 0
    while headers < 2:  # each snapshot as it comes (the test's own timeout bounds a top that prints none)
        line = proc.stdout.readline()
        assert line, "top ended before its second snapshot"
        headers += line.startswith("mpsrun top - ")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err == "", err


def test_top_with_no_jobs_says_so_in_one_line(fake_gpu):
    """No running job: --once says so in one line and exits 0; --json gives an empty snapshot with the GPU's row."""
    out = _top("--once")
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "no running mpsrun job" in out.stdout, out
    snapshot = _snapshot()
    assert snapshot["jobs"] == [] and snapshot["ranks"] == [] and len(snapshot["gpus"]) == 1


def test_a_job_that_ends_while_top_watches_it(fake_gpu, short_tmp):
    """top, piped, watches a job of three ranks; the job ends as it would have without top (exit 0), and top goes on,
    its next snapshots showing no job, until Ctrl-C (exit 0)."""
    proc = subprocess.Popen([*MPSRUN, "top", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    job = _running("local", short_tmp)
    try:
        seen = False
        while not seen:  # until a snapshot shows the job's three ranks
            line = proc.stdout.readline()
            assert line, "top ended while the job ran"
            seen = " 1 job(s), 3 rank(s)" in line
    finally:
        out, err = _end(job, short_tmp)
    assert job.returncode == 0, err
    line = "the job's last snapshot"
    while " 0 job(s), 0 rank(s)" not in line:  # top went on: a snapshot shows no job
        line = proc.stdout.readline()
        assert line, "top ended after the job"
    proc.send_signal(signal.SIGINT)
    rest, errors = proc.communicate(timeout=30)
    assert proc.returncode == 0 and errors == "", errors
    settle(fake_gpu)


# A rank that, once running, replaces its own image with one whose environment says RANK=<odd> (same pid and start
# time, so the session's record still names it), then waits for a file.
_EXEC_WITH_RANK = """\
import os, sys, time
go, odd = sys.argv[1], sys.argv[2]
if os.environ.get("HOSTILE_DONE") != "1":
    os.execve(sys.executable, [sys.executable, __file__, go, odd], dict(os.environ, RANK=odd, HOSTILE_DONE="1"))
while not os.path.exists(go):
    time.sleep(0.05)
"""


def _sessions(fake_gpu) -> list[Path]:
    return [d for d in fake_gpu.session_dirs() if (d / "session.json").exists()]


def _started(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _go(job: subprocess.Popen, go: Path) -> tuple[str, str]:
    go.touch()
    return job.communicate(timeout=120)


@pytest.mark.parametrize("odd", ["\u00b2", "\u2460"])  # '²' and '①': str.isdigit() says yes, int() says no
def test_top_survives_a_rank_whose_RANK_is_an_odd_digit(fake_gpu, short_tmp, odd):
    """mpsrun top reads each rank's RANK from its environment. A rank that re-executes itself with RANK set to a
    character str.isdigit() accepts but int() refuses (a superscript two) must not make top fail: top must still
    print its table and exit 0 (the rank shown without a number, as a rank with a garbage RANK is)."""
    program = short_tmp / "odd_rank.py"
    program.write_text(_EXEC_WITH_RANK)
    go = short_tmp / "go"
    job = _started(job_argv("local", [], [sys.executable, str(program), str(go), odd], ranks=2))
    try:
        wait_for(lambda: _sessions(fake_gpu), timeout=60, what="the job's session")
        time.sleep(2)  # the ranks have started and re-executed themselves
        out = _top("--once")
    finally:
        _go(job, go)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "mpsrun top - " in out.stdout
    settle(fake_gpu)


# A rank that plants something at its session's usage.json (the file mpsrun top reads), then waits for a file. It
# holds no device memory, so its job's controller never publishes usage.json over what it planted.
_PLANT = """\
import os, sys, time
go, what = sys.argv[1], sys.argv[2]
usage = os.path.join(os.environ["MPSRUN_SESSION_DIR"], "usage.json")
if os.environ["RANK"] == "0":
    if os.path.lexists(usage):
        os.unlink(usage)
    if what == "fifo":
        os.mkfifo(usage)
    elif what == "zero":
        os.symlink("/dev/zero", usage)
    elif what == "nested":
        with open(usage, "w") as out:
            out.write("[" * 200000)
    elif what == "infinity":
        with open(usage, "w") as out:
            out.write('{"0": {"host": "elsewhere", "pid": 1, "peak": Infinity}}')
    open(go + ".planted", "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
"""


def _limited_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a runaway read fails here, not on the machine


@pytest.mark.parametrize("what", ["fifo", "zero", "nested", "infinity"])
def test_top_is_not_stopped_by_what_a_rank_plants_at_usage_json(fake_gpu, short_tmp, what):
    """A rank can write in its session's directory (MPSRUN_SESSION_DIR), so it can plant a FIFO, a symlink to
    /dev/zero, JSON nested 200000 deep or a peak of Infinity at usage.json, the file mpsrun top reads. runtime/files.py
    says the files a rank can reach are read without following a symlink, without blocking on opening, regular files
    only and up to a size; tools.md says top changes nothing and prints one table. top --once must still print its
    table and exit 0 within seconds (not hang on the FIFO, not read /dev/zero until memory runs out, not end in a
    traceback)."""
    program = short_tmp / "plant.py"
    program.write_text(_PLANT)
    go = short_tmp / "go"
    job = _started(job_argv("local", [], [sys.executable, str(program), str(go), what], ranks=2))
    try:
        wait_for(lambda: Path(str(go) + ".planted").exists(), timeout=60, what="the planted usage.json")
        try:
            out = subprocess.run([*MPSRUN, "top", "--once"], capture_output=True, text=True, timeout=20,
                                 preexec_fn=_limited_memory)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mpsrun top --once hung on a usage.json planted as {what}")
    finally:
        _go(job, go)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "2 rank(s)" in out.stdout.splitlines()[0], out.stdout
    settle(fake_gpu)


@pytest.mark.parametrize("interval", ["nan", "inf"])
def test_top_interval_that_is_not_a_finite_number_is_a_usage_error(fake_gpu, interval):
    """mpsrun top --interval S: a value that is no number of seconds (nan, inf) must be refused as any bad option is,
    with one line and exit 2, not print a table and then end in a traceback (exit 1) at its first sleep."""
    try:
        out = _top("--interval", interval)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpsrun top --interval {interval} ran on (it should be refused)")
    assert out.returncode == 2, (out.returncode, out.stderr[-600:])
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr


@contextlib.contextmanager
def _top_in_a_terminal(term: str, rows: int = 0) -> Iterator[tuple[int, subprocess.Popen]]:
    """``mpsrun top`` in a pseudo-terminal of type ``term`` (of ``rows`` rows and 100 columns, if given): the
    terminal's other end, and top's process (killed at the end should it still run: our own child)."""
    controller, terminal = os.openpty()
    if rows:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, 100, 0, 0))
    proc = subprocess.Popen([*MPSRUN, "top", "--interval", "0.2"], stdin=terminal, stdout=terminal, stderr=terminal,
                            env={**os.environ, "TERM": term}, start_new_session=True)
    os.close(terminal)
    try:
        yield controller, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)


def test_the_live_view_draws_in_a_terminal_and_q_leaves_it(fake_gpu, short_tmp):
    """In a terminal (a pseudo-terminal here), top draws its view with curses, refreshes, and leaves on q with exit 0,
    giving the terminal back (curses' alternate screen ended)."""
    probe = subprocess.run([sys.executable, "-c", "import curses, os; curses.setupterm('xterm', os.open('/dev/null', 1))"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no curses or no terminfo for xterm in this Python: {probe.stderr.decode()[-200:]}")
    with _top_in_a_terminal("xterm") as (controller, proc):
        shown = _read_until(controller, b"q: quit")
        os.write(controller, b"q")
        code = proc.wait(timeout=30)
        shown += _read_until(controller, b"\x1b[?1049l")  # the alternate screen left: the terminal as it was
    assert b"mpsrun top - " in shown and b"\x1b[?1049l" in shown and code == 0, shown[-2000:]


def test_a_terminal_curses_cannot_draw_on_gets_snapshots(fake_gpu):
    """A terminal whose TERM has no terminfo entry: top prints its tables as it does into a pipe (no traceback), and
    Ctrl-C (SIGINT) ends it with 0."""
    with _top_in_a_terminal("no-such-terminal") as (controller, proc):
        shown = _read_until(controller, b"GPU  SM %")
        shown += _read_until(controller, b"mpsrun top - ")  # a second table
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    assert shown.count(b"mpsrun top - ") >= 2 and b"q: quit" not in shown and b"Traceback" not in shown, shown[-2000:]
    assert code == 0


def _read_until(fd: int, wanted: bytes, timeout: float = 60) -> bytes:
    """What a terminal shows until ``wanted`` (or the timeout, or its other end is gone)."""
    shown = b""
    deadline = time.monotonic() + timeout
    while wanted not in shown and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                shown += os.read(fd, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                break
    return shown


def test_a_long_running_view_forgets_the_ranks_of_ended_jobs(fake_gpu, short_tmp):
    """A live view keeps each rank's process (for its CPU use) and peak between looks; once the job has ended, the next
    look keeps nothing of it, so a view left open for days does not grow with every job it saw."""
    from mpsrun.tools import top

    view = top.Top()
    job = _running("local", short_tmp)
    try:
        wait_for(lambda: len([r for r in view.snapshot().ranks if r.peak]) == 3, timeout=60, what="three ranks")
        kept = (len(view._processes), len(view._peaks))
    finally:
        _end(job, short_tmp)
    view.snapshot()
    assert kept == (3, 3) and (view._processes, view._peaks) == ({}, {})
    settle(fake_gpu)


def test_a_rank_whose_gpu_work_is_in_a_child_is_charged_its_memory(fake_gpu, short_tmp):
    """A rank whose CUDA context belongs to a child process (a rank that forks its workers): top charges the child's
    device memory to the rank, as the job's own account does (found from the GPU process up, not by scanning the
    machine's processes)."""
    program = fake("--in-child", "--hold", "60")  # the child holds the fake's 12 MiB and its context
    job = subprocess.Popen(job_argv("local", [], program, ranks=2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        snapshot = _ranks_seen(2)
    finally:
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=120)
    assert job.returncode == 130, err
    assert [(r["rank"], r["memory"], r["mps"]) for r in snapshot["ranks"]] == [(0, 12 + CONTEXT_MIB, True),
                                                                             (1, 12 + CONTEXT_MIB, True)]
    settle(fake_gpu)


#: Bytes a terminal acts on: ESC (CSI, OSC: the title, the clipboard), BEL, and every other C0 control but newline.
_CONTROLS = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f\x9b]")


@contextlib.contextmanager
def planted_job(base: Path, name: str, argv: list[str], ranks: list[dict[str, str]],
                usage: dict | None = None) -> Iterator[list[subprocess.Popen]]:
    """A session directory ``name`` under ``base`` planted as a rank can plant one (it knows its user's session
    root): a record whose owner is this test (alive) and whose ranks are sleeping processes with ``ranks``'
    environments, and ``usage``, as usage.json. Removed, the processes ended, at the end."""
    from mpsrun.runtime.processes import ProcessRef

    root = base / f"mpsrun-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    session = root / name
    session.mkdir(mode=0o700)
    processes = [subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"], env={**os.environ, **env})
                 for env in ranks]
    try:
        # Popen returns once exec has begun; the new image's environment is readable a moment later
        wait_for(lambda: all(Path(f"/proc/{p.pid}/environ").read_bytes() for p in processes), timeout=30,
                 what="the planted ranks' environments")
        refs = [ProcessRef.of(p.pid)._asdict() for p in processes]
        record = {"kind": "job", "owner": ProcessRef.of(os.getpid())._asdict(), "uid": os.getuid(),
                  "started": time.time(), "ranks": refs, "argv": argv}
        (session / "session.json").write_text(json.dumps(record))
        if usage is not None:
            (session / "usage.json").write_text(json.dumps(usage))
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(session)


_ESCAPES = "\x1b]0;PWNED\x07\x1b[2J"
_ODD_RANKS = ["1_0", "\u0663", "9" * 4000, " 1", "+1", "-1", _ESCAPES]


def test_what_ranks_and_records_say_reaches_the_terminal_escaped(fake_gpu):
    """A session directory named with an escape sequence, its record's argv, a rank's RANK, memory limit and GPU, and
    usage.json's hosts (OSC 52 writes the clipboard; a newline breaks the table), all set by a rank: top --once, top
    --json and status print none of them raw, top shows each escaped (LIMIT, HOST, the job's line), and reads RANK as
    mpsrun writes it, ASCII digits only, so 1_0, the Arabic-Indic three and a 4,000-digit value are no rank number.
    top printed them raw, read 1_0 as 10 and ٣ as 3, and a 4,000-digit rank stretched every row."""
    name = "s\x1b[31mRED"
    ranks = [{"RANK": odd, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={_ESCAPES}", "CUDA_VISIBLE_DEVICES": _ESCAPES}
             for odd in _ODD_RANKS]
    usage = {"7": {"host": "evil\x1b]52;c;cHduZWQ=\x07", "pid": 1, "peak": 1},
             "8": {"host": "two\nlines", "pid": 2, "peak": None}}
    with planted_job(fake_gpu.tmpdir, name, ["mpsrun", f"-x{_ESCAPES}", "python"], ranks, usage):
        once = _top("--once")
        snapshot = _snapshot()
        status = subprocess.run([*MPSRUN, "status"], capture_output=True, timeout=60)
    assert once.returncode == 0 and status.returncode == 0, (once.stderr, status.stderr)
    for shown in (once.stdout.encode(), status.stdout):
        assert not _CONTROLS.search(shown), shown[-2000:]
    assert "\\x1b]52;c;cHduZWQ=\\x07" in once.stdout and "two\\nlines" in once.stdout and "\\x1b[31mRED" in once.stdout
    assert "-x\\x1b]0;PWNED" in once.stdout and "\\x1b]0;PWNED" in once.stdout.split("LIMIT")[1]
    assert max(len(line) for line in once.stdout.splitlines()) < 400, once.stdout
    assert [r["rank"] for r in snapshot["ranks"] if r["state"] != "remote"] == [None] * len(_ODD_RANKS)
    assert b"\\x1b[31mRED" in status.stdout


def test_the_live_view_draws_what_it_cannot_fit_escaped_and_q_leaves_it(fake_gpu):
    """In a terminal of 8 rows, a host with a newline and an OSC 52 sequence in usage.json (a rank writes it): the live
    view draws it escaped, never raw, and q still leaves it (exit 0). curses raised on the newline; top then fell back
    to printing its tables raw, and q no longer worked."""
    probe = subprocess.run([sys.executable, "-c", "import curses, os; curses.setupterm('xterm', os.open('/dev/null', 1))"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no curses or no terminfo for xterm in this Python: {probe.stderr.decode()[-200:]}")
    usage = {str(rank): {"host": f"evil{rank}\n\x1b]52;c;cHduZWQ=\x07" * 3, "pid": rank, "peak": 1}
             for rank in range(20)}
    with planted_job(fake_gpu.tmpdir, "sevil", ["mpsrun"], [], usage), _top_in_a_terminal("xterm", rows=8) as (
            controller, proc):
        shown = _read_until(controller, b"evil2")  # the last row 8 rows hold (of 20)
        os.write(controller, b"q")
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"q did not leave top; it showed {shown[-600:]!r}")
        shown += _read_until(controller, b"\x1b[?1049l")
    assert b"\x1b]52" not in shown and b"evil0\\n" in shown and code == 0, shown[-2000:]


def test_top_without_a_gpu_says_so_in_a_line(no_gpu):
    """On a machine without a GPU (a job runs there without MPS), top --once shows the job's rank and says in one line
    that NVML sees no GPU; it printed the GPU table's header over no row."""
    with planted_job(no_gpu, "snogpu", ["mpsrun", "true"], [{"RANK": "0"}]):
        out = _top("--once")
    assert out.returncode == 0 and "1 rank(s)" in out.stdout, out
    assert out.stdout.splitlines()[-1] == "GPU: none that NVML can see" and "MPS CLIENTS" not in out.stdout, out.stdout


def test_a_look_scans_no_process_table(fake_gpu, monkeypatch):
    """A snapshot reads each shown rank's process and each GPU process's parents, never the machine's whole process
    table: psutil's process_iter and children() (which scans it) are not called. Each row called children(recursive=
    True), a scan of every process of the machine per rank (151 s for 1,000 ranks among 2,000 processes)."""
    import psutil

    from mpsrun.tools import top

    scans = []
    monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: scans.append("process_iter") or iter(()))
    monkeypatch.setattr(psutil.Process, "children", lambda *a, **k: scans.append("children") or [])
    with planted_job(fake_gpu.tmpdir, "sscan", ["mpsrun"], [{"RANK": str(rank)} for rank in range(3)]):
        snapshot = top.Top().snapshot()
    assert [row.rank for row in snapshot.ranks] == [0, 1, 2] and scans == [], scans
