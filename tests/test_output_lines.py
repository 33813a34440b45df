"""Every rank's output arrives in whole lines and all of it, on every path, however the rank buffers (issue 48).

A Python print under ``PYTHONUNBUFFERED=1`` writes its text and its newline apart, and a block-buffered rank cuts
its lines where its 8 KiB buffer fills: written to a shared stdout as they came, the lines of 4 ranks were mixed
(7,145 of 8,000 under the local launcher). Each rank's supervisor now passes its output on in whole lines, and
what the ranks wrote is passed on before the job ends, also to a reader slower than the job.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import tty
from pathlib import Path

import psutil
import pytest
from helpers import MPSRUN, PATHS, gpu_job_argv, job_argv, settle, wait_for

from mpsrun.runtime.output import PIPE_BUF, LineWriter

#: Every rank waits for all to have started (a file each in ``sys.argv[1]``), so they print at once.
TOGETHER = ("import os, sys, time\nr = os.environ['RANK']\nopen(os.path.join(sys.argv[1], r), 'w').close()\n"
            "while len(os.listdir(sys.argv[1])) < int(os.environ['WORLD_SIZE']):\n    time.sleep(0.001)\n")
#: 2,000 lines per rank, of lengths that cross every piece and buffer boundary, each naming its rank and number.
PRINTS = TOGETHER + "for i in range(2000):\n    print('rank', r, 'line', i, 'x' * (i * 37 % 300))\n"
LINE = re.compile(r"(?:\[rank (\d+)\] )?rank (\d+) line (\d+)(?: (x*))?")


def lines_of_each_rank(stdout: str, ranks: int, tagged: bool = False) -> dict[int, list[int]]:
    """Each rank's line numbers in the order they came; fails on a line that is not one whole line of a rank."""
    seen: dict[int, list[int]] = {rank: [] for rank in range(ranks)}
    for line in stdout.splitlines():
        match = LINE.fullmatch(line)
        assert match is not None, f"a mixed line: {line[:200]!r}"
        tag, rank, number, xs = match.groups()
        assert (tag is not None) == tagged and (tag is None or tag == rank), line[:200]
        assert xs is None or len(xs) == int(number) * 37 % 300, line[:200]  # PRINTS' lines end with their x's
        seen[int(rank)].append(int(number))
    return seen


def slow_read(job: subprocess.Popen[bytes], pause: float = 0.02) -> bytes:
    """All of ``job``'s stdout, taken 4 KiB at a time with a pause between: a reader slower than the job."""
    assert job.stdout is not None
    chunks = []
    while chunk := job.stdout.read1(4096):  # type: ignore[attr-defined]
        chunks.append(chunk)
        time.sleep(pause)
    return b"".join(chunks)


def four_ranks_print(argv_of, path: str, how: str, directory: Path, monkeypatch) -> None:
    """4 ranks of ``path`` (``argv_of``: job_argv or gpu_job_argv) print PRINTS ``how``; every line is whole."""
    if how == "unbuffered":
        monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    else:
        monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    options = ["--tag-output"] if how == "tagged" else []
    out = subprocess.run(argv_of(path, options, [sys.executable, "-c", PRINTS, str(directory)], ranks=4),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert lines_of_each_rank(out.stdout, 4, tagged=how == "tagged") == {r: list(range(2000)) for r in range(4)}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["unbuffered", "buffered", "tagged"])
@pytest.mark.parametrize("path", PATHS)
def test_four_ranks_lines_are_never_mixed(fake_gpu, short_tmp, path, how, monkeypatch):
    """4 ranks printing 2,000 lines each, unbuffered (text and newline written apart), block-buffered (lines cut
    at 8 KiB) and tagged: every line is one whole line of one rank, and each rank's lines are all there, in order,
    on every path. Before, unbuffered output mixed 7,145 of 8,000 lines under the local launcher."""
    four_ranks_print(job_argv, path, how, short_tmp, monkeypatch)
    settle(fake_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["unbuffered", "buffered", "tagged"])
@pytest.mark.parametrize("path", ["local", "mpiexec", "hosts"])
def test_four_ranks_lines_are_never_mixed_on_the_gpu_machine(cupy_job, path, how, monkeypatch):
    """The same on the GPU machine, with real MPS and Open MPI, on the paths where mpsrun holds the output of a
    node's ranks (before, unbuffered: 5,625 of 8,000 lines mixed under the local launcher, 4,607 under mpiexec;
    then, with whole lines from each supervisor, Open MPI 4.1's forwarding still cut 14 under mpiexec, and 0-8 a
    round under --hosts). Under --per-node the user's launcher forwards each rank's output (docs/command-line.md,
    where a path differs)."""
    four_ranks_print(gpu_job_argv, path, how, cupy_job["ready"], monkeypatch)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_each_supervisor_writes_to_the_jobs_own_output(fake_gpu, tmp_path, path):
    """Where the job's ranks run on mpsrun's own node, each rank's supervisor writes the rank's lines straight to
    mpsrun's stdout and stderr (under an MPI launcher they come with the welcome), not through the launcher's
    forwarding, which cuts lines of different ranks into each other: a rank sees its parent's stdout and stderr be
    the files mpsrun's are."""
    code = ("import os\nfor fd in (1, 2):\n    print(os.environ['RANK'], fd, "
            "os.readlink(f'/proc/{os.getppid()}/fd/{fd}'), flush=True)\n")
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        subprocess.run(job_argv(path, [], [sys.executable, "-c", code], ranks=2), stdout=stdout, stderr=stderr,
                       timeout=120, check=True)
    seen = sorted(out.read_text().splitlines())
    assert seen == [f"{rank} {fd} {out if fd == 1 else err}" for rank in (0, 1) for fd in (1, 2)], (seen, err.read_text())
    settle(fake_gpu)


def test_the_ranks_of_a_host_write_to_one_output_under_hosts(fake_gpu, tmp_path):
    """Under --hosts the MPI launcher that mpsrun starts forwards each process's output in pieces, which cut lines
    of ranks that write at once. So a host's ranks write to one stdout and one stderr, those of the rank that
    started the host's keeper, each line under one lock: every rank's supervisor has the same two pipes (before,
    each had its own)."""
    code = ("import os\nfor fd in (1, 2):\n    print(os.environ['RANK'], fd, "
            "os.readlink(f'/proc/{os.getppid()}/fd/{fd}'), flush=True)\n")
    out = subprocess.run(job_argv("hosts", [], [sys.executable, "-c", code], ranks=3), capture_output=True,
                         text=True, timeout=120, check=True)
    seen = [line.split() for line in out.stdout.splitlines()]
    assert sorted((int(rank), int(fd)) for rank, fd, _ in seen) == [(r, fd) for r in range(3) for fd in (1, 2)]
    for fd in ("1", "2"):
        assert len({target for _, which, target in seen if which == fd}) == 1, seen
    settle(fake_gpu)


def test_lines_longer_than_a_pipe_write_stay_whole_in_the_local_launcher(fake_gpu, short_tmp, monkeypatch):
    """Lines of 3 to 20 kB (past PIPE_BUF, which the kernel writes to a pipe in one piece) from 4 unbuffered ranks
    into one pipe: each stays whole (the ranks' supervisors take turns on a lock for every write)."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    code = TOGETHER + "for i in range(60):\n    print('rank', r, 'line', i, 'x' * (3000 + i * 997 % 17000))\n"
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", code, str(short_tmp)], ranks=4),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        rank, number, xs = re.fullmatch(r"rank (\d) line (\d+) (x*)", line).groups()  # type: ignore[union-attr]
        assert len(xs) == 3000 + int(number) * 997 % 17000, line[:100]
    assert len(out.stdout.splitlines()) == 240
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_slow_reader_gets_all_the_output(fake_gpu, path):
    """A job whose ranks print 400 kB in all and end, read at about 200 kB/s with --grace 0: every line arrives.
    The MPI launcher was stopped 0.5 s after the ranks ended while it still passed their output on (454 of 20,000
    lines lost with --grace 1); it now gets that time only once our output has been read."""
    code = "import os\nr = os.environ['RANK']\nfor i in range(5000):\n    print('rank', r, 'line', i)\n"
    job = subprocess.Popen(job_argv(path, ["--grace", "0"], [sys.executable, "-c", code], ranks=4),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout = slow_read(job)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr
    assert lines_of_each_rank(stdout.decode(), 4) == {r: list(range(5000)) for r in range(4)}
    settle(fake_gpu)


FAIL_FAST = """\
import os, sys, time
rank, flags, mode = int(os.environ['RANK']), sys.argv[1], sys.argv[2]
if rank == 1:  # fails once every other rank has printed all its lines
    while len(os.listdir(flags)) < int(os.environ['WORLD_SIZE']) - 1:
        time.sleep(0.005)
    sys.exit(3)
for i in range(3000):
    print('rank', rank, 'line', i)
sys.stdout.flush()
open(os.path.join(flags, str(rank)), 'w').close()
if mode == 'stays':
    time.sleep(60)
"""


def fail_fast(argv_of, path: str, mode: str, flags: Path) -> None:
    """FAIL_FAST as 3 ranks of ``path``, read slowly: exit 3, and every line ranks 0 and 2 printed is there."""
    flags.mkdir()
    job = subprocess.Popen(argv_of(path, ["--grace", "0"], [sys.executable, "-c", FAIL_FAST, str(flags), mode],
                                   ranks=3), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout = slow_read(job, pause=0.01)
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 3, stderr[-3000:]
    lines = stdout.decode().splitlines()
    for rank in (0, 2):
        assert [line for line in lines if line.startswith(f"rank {rank} ")] == [
            f"rank {rank} line {i}" for i in range(3000)], stderr[-3000:]


@pytest.mark.parametrize("mode", ["ends", "stays"])
@pytest.mark.parametrize("path", PATHS)
def test_what_ranks_printed_before_a_failure_stops_the_job_is_all_there(fake_gpu, short_tmp, path, mode):
    """Ranks 0 and 2 print 3,000 lines, then say so (a file); rank 1 then exits 3 and the job is stopped while
    their output is still on its way to a slow reader (the ranks end, or are still running and are stopped):
    exit 3, and every line they printed is there."""
    fail_fast(job_argv, path, mode, short_tmp / "printed")
    settle(fake_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ends", "stays"])
def test_what_ranks_printed_before_a_failure_is_all_there_on_the_gpu_machine(cupy_job, mode):
    """The same on the GPU machine, with real MPS, under the local launcher."""
    fail_fast(gpu_job_argv, "local", mode, cupy_job["ready"] / "printed")


def test_a_partial_last_line(fake_gpu):
    """A last line without its newline: one rank's output is passed on byte for byte; of several ranks', each is
    ended with a newline, so the next rank's line starts on its own (it ran on: ``partial-0full-1``)."""
    code = "import os, sys; sys.stdout.write('full-' + os.environ['RANK'] + '\\npartial-' + os.environ['RANK'])"
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", code], ranks=1), capture_output=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == b"full-0\npartial-0", out
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", code], ranks=3), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted([f"full-{r}" for r in range(3)] + [
        f"partial-{r}" for r in range(3)])
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_a_rank_writing_to_a_terminal_sees_one(fake_gpu, short_tmp, path):
    """mpsrun's stdout a terminal: each rank's stdout is a terminal too (Python then writes line by line, as it did
    when the ranks wrote to ours) and its stderr a pipe, as ours is; its newlines stay newlines, and a prompt
    without its newline appears while the rank waits for its answer."""
    answer = short_tmp / "answer"
    code = (f"import os, sys, time\nprint('tty', sys.stdout.isatty(), sys.stderr.isatty())\n"
            f"sys.stdout.write('name? '); sys.stdout.flush()\n"
            f"while not os.path.exists({str(answer)!r}): time.sleep(0.01)\nprint('done')\n")
    reader, terminal = os.openpty()
    tty.setraw(terminal)  # our terminal's own newline translation aside: only the rank's is looked at
    job = subprocess.Popen(job_argv(path, [], [sys.executable, "-c", code], ranks=1), stdout=terminal,
                           stderr=subprocess.PIPE)
    os.close(terminal)
    seen = bytearray()

    def prompted() -> bool:
        if select.select([reader], [], [], 0.1)[0]:
            seen.extend(os.read(reader, 4096))
        return b"name? " in seen

    wait_for(prompted, timeout=60, what="the prompt did not appear", proc=job)
    answer.touch()
    while True:
        try:
            chunk = os.read(reader, 4096)
        except OSError:  # EIO: the job is over, and with it every writer
            break
        if not chunk:
            break
        seen.extend(chunk)
    os.close(reader)
    assert job.wait(timeout=60) == 0, job.stderr.read() if job.stderr else ""
    assert bytes(seen) == b"tty True False\nname? done\n", bytes(seen)  # stderr: a pipe, as ours
    settle(fake_gpu)


# -- the writer itself ----------------------------------------------------------------------------------------


def written(monkeypatch, records: list[bytes], **options) -> tuple[LineWriter, list[bytes]]:
    """A LineWriter whose writes are recorded, fed ``records``."""
    writes: list[bytes] = []
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or len(data))
    writer = LineWriter(1, **options)
    for record in records:
        writer.feed(record)
    return writer, writes


def test_whole_lines_are_written_in_pieces_a_pipe_keeps_whole(monkeypatch):
    """Lines are written in pieces of at most PIPE_BUF bytes that end with a newline (a reader that takes what a
    pipe holds never gets part of a line); a longer line is a piece of its own; nothing is lost or reordered."""
    data = b"".join(b"%d %s\n" % (i, b"x" * (i * 131 % 900)) for i in range(300)) + b"y" * 9000 + b"\nshort\n"
    _, writes = written(monkeypatch, [data[:5000], data[5000:70000], data[70000:]])
    assert b"".join(writes) == data
    for piece in writes:
        assert piece.endswith(b"\n") and (len(piece) <= PIPE_BUF or piece.count(b"\n") == 1), len(piece)


def test_a_partial_line_waits_for_its_end(monkeypatch):
    """Text and its newline written apart are written as one line; a partial line is written at the stream's end,
    ended with a newline for several ranks (``end_partial``) and as it is for one; ``flush_partial`` writes it as
    it is (a prompt), and the tag is put before every line."""
    writer, writes = written(monkeypatch, [b"one", b"\n", b"two"], end_partial=False)
    assert writes == [b"one\n"] and writer.partial_since is not None
    writer.finish()
    assert writes == [b"one\n", b"two"]
    writer, writes = written(monkeypatch, [b"a\nb\nc"], prefix=b"[rank 3] ")
    writer.finish()
    assert writes == [b"[rank 3] a\n[rank 3] b\n", b"[rank 3] c\n"]
    writer, writes = written(monkeypatch, [b"name? "])
    writer.flush_partial()
    writer.feed(b"Ann\n")
    assert writes == [b"name? ", b"Ann\n"] and writer.partial_since is None


def test_our_gone_reader_is_noted_not_raised(tmp_path: Path):
    """Writing into a pipe whose reader has gone: the writer says so (False), and raises nothing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    writer = LineWriter(write_end)
    assert writer.feed(b"line\n") is False and writer.broken
    os.close(write_end)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_a_non_blocking_output_gets_all_the_lines(fake_gpu, path):
    """mpsrun's stdout a pipe left non-blocking (its flags belong to the pipe, shared with whoever set them) and read
    slowly: every line still arrives and nothing is said of lost output. The supervisors, which now write to
    mpsrun's own stdout, took a full pipe's EAGAIN for an output that cannot be written and dropped the rest."""
    code = "import os\nr = os.environ['RANK']\nfor i in range(20000):\n    print('rank', r, 'line', i)\n"
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    job = subprocess.Popen(job_argv(path, [], [sys.executable, "-c", code], ranks=2), stdout=write_end,
                           stderr=subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        got = bytearray()
        while chunk := reader.read1(4096):  # type: ignore[attr-defined]
            got.extend(chunk)
            time.sleep(0.01)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0 and not err, err
    assert lines_of_each_rank(got.decode(), 2) == {r: list(range(20000)) for r in range(2)}
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


def test_a_closed_stdout_is_no_traceback(fake_gpu):
    """`mpsrun --tag-output ... | head -1`: the reader goes away; no traceback, the job ends, nothing is left."""
    job = subprocess.Popen([*MPSRUN, "-np", "2", "--launcher", "local", "--tag-output", sys.executable, "-c",
                            "import itertools\nfor i in itertools.count(): print(i, flush=True)"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline().startswith("[rank ")
    job.stdout.close()
    _, err = job.communicate(timeout=60)
    ours = [line for line in err.splitlines() if not line.startswith("[rank ")]  # a Python rank's own EPIPE is its own
    assert not any("Traceback" in line for line in ours), err
    settle(fake_gpu)


def test_an_endless_line_keeps_memory_bounded(fake_gpu):
    """A rank writing 100 MB with no newline under --tag-output: no process of the job grows past 150 MB."""
    code = "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))\nsys.stdout.flush()"
    job = subprocess.Popen([*MPSRUN, "-np", "1", "--launcher", "local", "--tag-output", sys.executable, "-c", code],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    while job.poll() is None:
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.Error:
                continue
        job.stdout.read(1 << 22)
    job.communicate(timeout=60)
    assert job.returncode == 0 and peak < 150 << 20, peak


@pytest.mark.mpiexec
def test_a_long_tagged_line_stays_one_line(fake_gpu):
    """--tag-output keeps a 200 kB line as one tagged line (pieces only past 1 MiB)."""
    code = "import sys; sys.stdout.write('x' * 200000 + '\\n')"
    out = subprocess.run(job_argv("local", ["--tag-output"], [sys.executable, "-c", code], ranks=2),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(len(line) for line in out.stdout.splitlines()) == [200009, 200009]
    settle(fake_gpu)
