"""mpsrun.shared.api without a GPU: publishing, waiting, attaching, releasing, and what a killed rank leaves.

The CUDA calls go to a test double (tests/fake_cuda: cuda.core's IPC memory pools over a memfd, CuPy over NumPy),
so the code that runs on a GPU runs here too, with real UNIX sockets and real descriptor passing between the
real processes of real jobs. Without the double, the same API falls back to host memory (NumPy).
"""

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from helpers import FAKE_CUDA, PATHS, job_argv, reports, settle, wait_ready
from helpers import run_source as run

from mpsrun import mps_session
from mpsrun.errors import SharedArrayError
from mpsrun.runtime.deadline import Deadline
from mpsrun.shared.handoff import HandoffError, Publisher, Subscription, join, take_over
from mpsrun.shared.memory import HostMemory

pytestmark = pytest.mark.mpiexec

RANK = """
import json, os, sys, time
import numpy
from mpsrun import shared
rank = int(os.environ["RANK"])
hold = float(os.environ.get("HOLD", "0.5"))
fill_wait = float(os.environ.get("FILL_WAIT", "0"))

def write_report(text):  # whole or not at all: the test may read it while this rank runs
    path = os.path.join(os.environ["REPORT_DIR"], f"{rank}.json")
    open(path + ".tmp", "w").write(text)
    os.replace(path + ".tmp", path)

filled = None

def others_waiting():  # the ranks that ask while we fill: connected to our publisher, waiting for its answer
    from mpsrun.shared import handoff
    return sum(len(h._waiting) for h in list(handoff._open) if isinstance(h, handoff.Publisher))

def asked_by_all():  # every rank has asked for the table (FILL_AFTER_ASKED): its fill can no longer be missed
    end = time.monotonic() + 60
    while time.monotonic() < end and len([n for n in os.listdir(os.environ["REPORT_DIR"]) if n.startswith(
            "asked.")]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)

def fill(out):
    global filled
    if os.environ.get("FILL_AFTER_ASKED"):
        asked_by_all()
    end = time.monotonic() + 30
    while os.environ.get("FILL_AFTER_OTHERS") and others_waiting() < int(os.environ["WORLD_SIZE"]) - 1 \
            and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(fill_wait)
    if os.environ.get("FILL_FAILS"):
        raise ValueError("no such table")
    out[...] = numpy.arange(out.size, dtype=out.dtype).reshape(out.shape)
    filled = time.time()

if os.environ.get("FILL_AFTER_ASKED"):
    shared.array("warm-up", 1, "uint8")  # the modules and the memory are ready: asking now takes milliseconds
    open(os.path.join(os.environ["REPORT_DIR"], f"asked.{rank}"), "w").close()
started, asked = time.monotonic(), time.time()
try:
    table = shared.array("xs-table", (256, 1024), "float32", init=fill, timeout=float(os.environ.get("WAIT", "60")))
except Exception as exc:
    print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    write_report(json.dumps({"error": str(exc)}))
    end = time.monotonic() + 30
    while os.environ.get("LINGER") and time.monotonic() < end and len([n for n in os.listdir(
            os.environ["REPORT_DIR"]) if n.endswith(".json")]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)  # until every rank's error is written, before fail-fast stops the others
    raise SystemExit(5)
report = {"rank": rank, "sum": float(table.sum()), "first": float(table[1, 0]), "type": type(table).__module__,
          "writable": bool(getattr(table, "flags", None) and table.flags.writeable), "waited": time.monotonic() - started,
          "asked": asked, "filled": filled, "got": time.time()}
write_report(json.dumps(report))
if os.environ.get("KILL_RANK") == str(rank):
    os.kill(os.getpid(), 9)
time.sleep(hold)
"""
EXPECTED_SUM = float(sum(range(256 * 1024)))


def allocations(log):
    """The device allocations the CUDA double logged (pid, bytes, device), less RANK's 1-byte warm-up arrays."""
    entries = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return [entry for entry in entries if entry[1] != "1"]


@pytest.fixture
def fake_cuda(monkeypatch, short_tmp):
    """Ranks see the CUDA double; every allocation it makes is logged."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(FAKE_CUDA)]))
    log = short_tmp / "allocations"
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    monkeypatch.setenv("REPORT_DIR", str(short_tmp))
    return log


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_on_a_gpu_reads_one_copy(fake_gpu, fake_cuda, short_tmp, monkeypatch, path):
    """On every path, one rank per GPU allocates and fills the table and the others map that one copy: the same
    data in every rank, one allocation of its size on the GPU. (The fill starts once every rank has asked: on a
    loaded machine a rank that asked after the holder had ended filled anew, as documented: 1 of 5 fresh runs.)"""
    monkeypatch.setenv("FILL_AFTER_ASKED", "1")
    out = run(RANK, ranks=4, path=path)
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(r["sum"] == EXPECTED_SUM and r["first"] == 1024.0 and r["type"] == "numpy" for r in seen.values())
    assert [int(size) for _, size, _ in allocations(fake_cuda)] == [256 * 1024 * 4]
    settle(fake_gpu)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_each_gpu_has_its_own_copy(fake_gpu, fake_cuda, short_tmp, monkeypatch):
    """Ranks on two GPUs: one copy per GPU, each filled once, every rank reading the same data. (The fills start
    once every rank has asked: a rank that asks after every holder has ended fills anew, as documented.)"""
    monkeypatch.setenv("FILL_AFTER_ASKED", "1")
    out = run(RANK, ranks=4)
    assert out.returncode == 0, out.stderr
    assert all(r["sum"] == EXPECTED_SUM for r in reports(short_tmp).values())
    assert sorted(device for _, _, device in allocations(fake_cuda)) == sorted(fake_gpu.uuids)
    settle(fake_gpu)


def test_ranks_wait_for_the_filling_rank(fake_gpu, fake_cuda, short_tmp, monkeypatch):
    """A slow fill: the other ranks wait for it (no copy of their own), then read what it filled."""
    monkeypatch.setenv("FILL_AFTER_OTHERS", "1")  # however late a loaded machine starts them
    monkeypatch.setenv("FILL_WAIT", "0.5")
    out = run(RANK, ranks=3)
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert all(r["sum"] == EXPECTED_SUM for r in seen.values()) and len(allocations(fake_cuda)) == 1
    [filled] = [r["filled"] for r in seen.values() if r["filled"] is not None]
    assert all(r["got"] >= filled for r in seen.values())  # nobody had the table before it was filled
    assert sum(r["asked"] < filled for r in seen.values()) >= 2  # and the others asked while it was being filled
    settle(fake_gpu)


def test_the_wait_has_a_deadline_and_a_clear_error(fake_gpu, fake_cuda, short_tmp, monkeypatch):
    """A fill slower than the others' deadline: they fail with one line saying what they waited for."""
    monkeypatch.setenv("FILL_WAIT", "5")
    monkeypatch.setenv("WAIT", "0.5")
    out = run(RANK, ranks=3, options=["--grace", "1"])
    assert out.returncode == 5, out.stderr
    assert "SharedArrayError: shared array 'xs-table': the region was not ready within 0.5 s" in out.stderr
    settle(fake_gpu)


def test_a_failed_fill_is_every_ranks_error(fake_gpu, fake_cuda, short_tmp, monkeypatch):
    """The filling rank's init raises: it fails with its own error, and the ranks waiting for it hear why. (Its
    fill starts once the others wait for it: a rank that asks after a failed fill fills again, as documented.)"""
    monkeypatch.setenv("FILL_FAILS", "1")
    monkeypatch.setenv("FILL_AFTER_OTHERS", "1")  # they wait for it when it fails (a later rank would fill anew)
    monkeypatch.setenv("LINGER", "1")
    out = run(RANK, ranks=3, options=["--grace", "1"])
    assert out.returncode == 5, out.stderr
    seen = {rank: r["error"] for rank, r in reports(short_tmp).items()}
    filler = [rank for rank, error in seen.items() if error == "no such table"]  # its own error
    assert len(filler) == 1 and len(seen) == 3, seen
    assert [e for r, e in seen.items() if r != filler[0]] == [
        f"shared array 'xs-table': rank {filler[0]} could not fill it: ValueError('no such table')"] * 2, seen
    settle(fake_gpu)


@pytest.mark.parametrize("killed", [0, 1])
@pytest.mark.parametrize("path", ["local", "per-node"])
def test_a_sigkilled_rank_leaves_nothing(fake_gpu, fake_cuda, short_tmp, monkeypatch, path, killed):
    """The rank that filled the table, or one that maps it, is SIGKILLed: the job fails with 137 and leaves no
    process, socket, lock or directory (the session directory holds them all)."""
    monkeypatch.setenv("KILL_RANK", str(killed))
    monkeypatch.setenv("HOLD", "10")
    out = run(RANK, ranks=3, options=["--grace", "1"], path=path)
    assert out.returncode == 137, out.stderr
    settle(fake_gpu)


def test_a_mismatched_shape_is_refused(fake_gpu, fake_cuda, short_tmp):
    """Ranks that ask for different shapes under one name: the later ones get a clear error naming both."""
    program = """
import os, time
from mpsrun import shared
n = 10 if os.environ['RANK'] == '0' else 11
def wait(name):  # (rank 0 holds its table until rank 1 has asked: once the table is gone, 11 is a fresh table)
    end = time.monotonic() + 30
    while not os.path.exists(os.path.join(os.environ['REPORT_DIR'], name)) and time.monotonic() < end:
        time.sleep(0.01)
if n == 11:
    wait('published')
try:
    shared.array('t', (n,), 'int64', data=list(range(n)))
finally:
    open(os.path.join(os.environ['REPORT_DIR'], 'published' if n == 10 else 'asked'), 'w').close()
wait('asked')
"""
    out = run(program, ranks=2, options=["--grace", "1"])
    assert out.returncode == 1
    assert "shared array 't' is (10,) int64 for rank 0, but (11,) int64 was asked for here" in out.stderr
    settle(fake_gpu)


def test_without_the_cuda_libraries_it_shares_host_memory_and_says_so(fake_gpu, short_tmp, monkeypatch):
    """No CuPy: one line says so, the table is shared host memory, read-only where mapped."""
    monkeypatch.setenv("REPORT_DIR", str(short_tmp))
    out = run(RANK, ranks=3)
    assert out.returncode == 0, out.stderr
    assert "mpsrun.shared.api: cupy is not installed: sharing host memory as read-only NumPy arrays" in out.stderr
    seen = reports(short_tmp)
    assert all(r["sum"] == EXPECTED_SUM for r in seen.values())
    assert not any(r["writable"] for r in seen.values())  # read-only everywhere, the filling rank's view too
    settle(fake_gpu)


def test_outside_a_job_it_is_a_clear_error(monkeypatch):
    """Called where no mpsrun job or session is: one clear error, not a hang."""
    from mpsrun import shared

    monkeypatch.delenv("MPSRUN_SESSION_DIR", raising=False)
    with pytest.raises(shared.SharedArrayError, match="MPSRUN_SESSION_DIR is not set"):
        shared.array("t", 4, "float64")


def share_and_sum(_):
    import numpy

    from mpsrun import shared
    table = shared.array("pool-table", (1000,), "float64", data=numpy.ones(1000))
    return float(table.sum())


def test_workers_of_mps_session_share_it(fake_gpu, fake_cuda, monkeypatch):
    """The workers of an mps_session() spawn pool share one copy too, and the handles live in its directory."""
    import multiprocessing

    monkeypatch.syspath_prepend(str(FAKE_CUDA))  # spawn workers start with this process's sys.path

    with mps_session(gpu=0) as session:
        with multiprocessing.get_context("spawn").Pool(3) as pool:
            assert pool.map(share_and_sum, range(6)) == [1000.0] * 6
        shared_dir = session.dirs.root / "shared"
        assert stat.S_IMODE(shared_dir.stat().st_mode) == 0o700
    assert len(allocations(fake_cuda)) == 1


def test_handles_travel_only_through_a_private_directory(fake_gpu, fake_cuda, short_tmp):
    """The socket and lock live in the session's 0700 directory: nothing world-readable, nothing outside it."""
    program = ("import os, stat, sys, time\nfrom mpsrun import shared\nshared.array('t', 8, 'int64', data=range(8))\n"
               "d = os.path.join(os.environ['MPSRUN_SESSION_DIR'], 'shared')\n"
               "modes = {n: stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) for n in os.listdir(d)}\n"
               "modes['.'] = stat.S_IMODE(os.stat(d).st_mode)\nos.write(1, repr(modes).encode() + b'\\n')\n"
               "time.sleep(0.5)\n")  # one write: under PYTHONUNBUFFERED print() writes the newline apart
    out = run(program, ranks=2)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        modes = eval(line)  # noqa: S307 - our own program's output
        assert modes["."] == 0o700 and all(mode & 0o077 == 0 for mode in modes.values()), modes
    settle(fake_gpu)


# -- the handoff protocol itself, between real processes --------------------------------------------------

SUBSCRIBER = """
import os, sys, time
from pathlib import Path
from mpsrun.runtime.deadline import Deadline
from mpsrun.shared.handoff import join
held = join(Path(sys.argv[1]), "k", Deadline(30))
print(type(held).__name__, held.header["n"], flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_killed_subscriber_releases_its_hold(short_tmp):
    """The publisher counts subscribers by their connections: a SIGKILLed one stops counting at once."""
    publisher = join(short_tmp, "k", Deadline(5))
    assert isinstance(publisher, Publisher)
    region, fd, _ = HostMemory().allocate(16)
    publisher.publish({"n": 16}, fd)
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, str(short_tmp), "60"], stdout=subprocess.PIPE,
                           text=True)
    try:
        assert sub.stdout.readline().split()[:2] == ["Subscription", "16"]
        assert publisher.subscribers == 1
        sub.kill()
        sub.wait()
        assert publisher.wait_released(Deadline(5))
    finally:
        sub.kill()
        publisher.close()
        region.close()
    assert sorted(p.name for p in short_tmp.iterdir()) == ["k.lock"]  # the socket went with the publisher


def test_a_subscriber_is_counted_before_it_can_map_the_region(short_tmp, monkeypatch):
    """The publisher counts a subscriber before it hands over the descriptor: from the moment a subscriber can map
    the region, the filling rank's release() waits for it. (It was counted only after the send, so a release() in
    that window returned while another rank still mapped the array; here the publisher's thread is held right
    after the send, so the window is open every time.)"""
    sent, checked = threading.Event(), threading.Event()
    real_send_fds = socket.send_fds

    def send_then_hold(sock, buffers, fds, *args):
        result = real_send_fds(sock, buffers, fds, *args)
        if fds and threading.current_thread().name.startswith("mpsrun-share-"):
            sent.set()
            checked.wait(10)  # the test looks at the count meanwhile
        return result

    monkeypatch.setattr(socket, "send_fds", send_then_hold)
    publisher = join(short_tmp, "k", Deadline(5))
    assert isinstance(publisher, Publisher)
    region, fd, _ = HostMemory().allocate(16)
    publisher.publish({"n": 16}, fd)
    held = None
    try:
        held = join(short_tmp, "k", Deadline(5))
        assert isinstance(held, Subscription)
        assert sent.wait(5)  # the publisher's thread has sent it, and now waits
        assert publisher.subscribers == 1
        assert not publisher.wait_released(Deadline(0))
    finally:
        checked.set()
        if held is not None:
            held.release()
        assert publisher.wait_released(Deadline(5))
        publisher.close()
        region.close()


def test_a_publisher_killed_before_it_was_ready_is_replaced(short_tmp):
    """A publisher dies (SIGKILL) before publishing: a waiting subscriber takes the lock and publishes itself."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from mpsrun.runtime.deadline import Deadline\nfrom mpsrun.shared.handoff import join\n"
                               f"join(Path({str(short_tmp)!r}), 'k', Deadline(5))\nprint('locked', flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(HandoffError, match="not ready within 0.3 s"):
            join(short_tmp, "k", Deadline(0.3))  # it holds the lock and never publishes
        holder.kill()
        holder.wait()
        replacement = join(short_tmp, "k", Deadline(5))
        assert isinstance(replacement, Publisher)
        replacement.close()
    finally:
        holder.kill()


def taken_over(directory, held, end, byte):
    """End the publisher (``end()``) while ``held`` watches: it must take over, and a later caller must map the same
    memory (filled with ``byte``), not a new copy."""
    took_over = []
    held.watch(lambda: took_over.append(take_over(directory, "k", held)))
    end()
    deadline = time.monotonic() + 10
    while not took_over:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert isinstance(took_over[0], Publisher)
    later = join(directory, "k", Deadline(5))
    assert isinstance(later, Subscription) and later.header["n"] == 16
    assert HostMemory().attach(os.dup(later.fd), b"", 16).view((16,), "uint8").tolist() == [byte] * 16
    later.release()
    took_over[0].close()
    held.release()


def test_a_subscriber_takes_over_when_the_publisher_ends(short_tmp):
    """The publisher ends while a subscriber holds the region: the subscriber publishes the same memory (its
    descriptor), so a later caller maps that copy instead of filling another."""
    publisher = join(short_tmp, "k", Deadline(5))
    region, fd, _ = HostMemory().allocate(16)
    region.view((16,), "uint8")[:] = 7
    publisher.publish({"n": 16}, fd)
    first = join(short_tmp, "k", Deadline(5))
    assert isinstance(first, Subscription)

    def end():
        publisher.close()
        region.close()

    taken_over(short_tmp, first, end, 7)


def test_release_waits_for_the_others_and_says_when_it_gives_up(fake_gpu, fake_cuda, short_tmp):
    """The filling rank's release() waits until the others have released the array; one that never does makes it
    give up after the timeout with an error saying how many still use it."""
    program = ("import os, time\nfrom mpsrun import shared\nfrom mpsrun.shared import api\nrank = os.environ['RANK']\n"
               "t = shared.array('t', 8, 'int64', data=range(8))\n"
               "if shared.role('t') == 'publisher':\n    end = time.monotonic() + 30\n"
               "    while api._held['t'].holder.subscribers < 1 and time.monotonic() < end:\n"
               "        time.sleep(0.01)  # until the other rank holds it\n"
               "    try:\n        shared.release('t', timeout=1)\n    except shared.SharedArrayError as e:\n"
               "        print('gave up:', e, flush=True)\n"
               "    open(os.path.join(os.environ['REPORT_DIR'], 'tried'), 'w').close()\nelse:\n"
               "    end = time.monotonic() + 30  # (held until the publisher has given up, however slow it is)\n"
               "    while not os.path.exists(os.path.join(os.environ['REPORT_DIR'], 'tried')) and time.monotonic() < end:\n"
               "        time.sleep(0.01)\n")
    out = run(program, ranks=2)
    assert out.returncode == 0, out.stderr
    assert "gave up: shared array 't': 1 rank(s) still used it after 1 s" in out.stdout
    settle(fake_gpu)


def test_a_killed_job_leaves_no_shared_files(fake_gpu, fake_cuda, short_tmp, monkeypatch):
    """mpsrun itself SIGKILLed while ranks hold a shared table: the reaper removes the directory with the
    sockets and locks, and every rank ends."""
    monkeypatch.setenv("HOLD", "30")
    job = subprocess.Popen(job_argv("local", [], [sys.executable, "-c", RANK], ranks=2), stderr=subprocess.DEVNULL)
    wait_ready(short_tmp, count=2, proc=job)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    settle(fake_gpu)


def test_an_array_larger_than_one_shared_region_holds_is_refused(fake_gpu, fake_cuda, short_tmp):
    """Over 4 GiB in one shared array (the CUDA driver measured crashing on importing one over about 6 GiB): a
    clear error before anything is allocated, saying to split it."""
    program = "from mpsrun import shared\nshared.array('huge', (5 << 30,), 'uint8')\n"
    out = run(program, ranks=1)
    assert out.returncode == 1
    assert "shared array 'huge' would be 5.0 GiB; one shared array holds at most 4 GiB" in out.stderr
    assert allocations(fake_cuda) == []
    settle(fake_gpu)


NESTED = """
import os, time
import numpy
from mpsrun import shared
def init(out):
    base = shared.array("base", (10,), "float32", data=numpy.ones(10, "float32"), timeout=20)
    out[...] = base.sum()
derived = shared.array("derived", (10,), "float32", init=init, timeout=20)
structured = shared.array("st", 3, [("a", "i4"), ("b", [("x", "f4"), ("y", "u1", (2,))])], timeout=20)
ready = shared.array("derived", numpy.int64(10), "float32", timeout=0)  # filled already: no wait needed
print(float(derived.sum()), ready is derived, structured.dtype.names, flush=True)
time.sleep(1)
"""


def test_init_may_share_other_arrays_and_dtypes_keep_their_structure(fake_gpu, short_tmp):
    """An init that itself uses another shared array works (each name waits on its own); structured dtypes and
    NumPy integer shapes are accepted alike by every rank; timeout=0 finds an array that is already filled."""
    out = run(NESTED, ranks=3)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["100.0 True ('a', 'b')"] * 3, out.stdout
    settle(fake_gpu)


@pytest.mark.parametrize(("shape", "dtype", "why"), [
    ((2.7,), "f4", "a shape of whole sizes"), (True, "f4", "a shape of whole sizes"),
    ((-1,), "f4", "non-negative sizes"), ((4,), object, "no Python objects"), ((1 << 62,), "f8", "under 4 EiB")])
def test_bad_arguments_are_refused_before_anything(monkeypatch, short_tmp, shape, dtype, why):
    """Shapes that are not whole non-negative sizes, object dtypes and absurd sizes: a SharedArrayError at once."""
    from mpsrun import shared

    monkeypatch.setenv("MPSRUN_SESSION_DIR", str(short_tmp))
    with pytest.raises(shared.SharedArrayError, match=why):
        shared.array("t", shape, dtype)


def test_an_empty_array_needs_no_sharing(monkeypatch, short_tmp):
    """A zero-size array is an empty array of the same kind; nothing is allocated or published."""
    from mpsrun import shared

    monkeypatch.setenv("MPSRUN_SESSION_DIR", str(short_tmp))
    empty = shared.array("t", (0, 7), "f8")
    assert empty.shape == (0, 7) and not (short_tmp / "shared").exists()


def test_a_session_directory_too_long_for_a_socket_is_a_clear_error(monkeypatch, short_tmp):
    """A session directory whose socket path would pass the kernel's 107 bytes: an error saying what to do."""
    from mpsrun import shared

    deep = short_tmp / ("d" * 90)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("MPSRUN_SESSION_DIR", str(deep))
    with pytest.raises(shared.SharedArrayError, match="too long for a socket path; set MPSRUN_TMPDIR"):
        shared.array("t", 4, "f8", timeout=1)


PUBLISHER = """
import sys, time
from pathlib import Path
from mpsrun.runtime.deadline import Deadline
from mpsrun.shared.memory import HostMemory
from mpsrun.shared.handoff import join
publisher = join(Path(sys.argv[1]), "k", Deadline(5))
region, fd, _ = HostMemory().allocate(16)
region.view((16,), "uint8")[:] = 9
publisher.publish({"n": 16}, fd)
print("published", flush=True)
time.sleep(60)
"""


def test_a_subscriber_takes_over_from_a_sigkilled_publisher(short_tmp):
    """The publishing process is SIGKILLed while we hold its region: we publish the same memory (its lock may
    outlive its sockets for a moment: the take-over waits for it), and a later caller maps that copy."""
    process = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(short_tmp)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "published"
        held = join(short_tmp, "k", Deadline(5))
        assert isinstance(held, Subscription)
        taken_over(short_tmp, held, lambda: (process.kill(), process.wait()), 9)
    finally:
        process.kill()
        process.wait()


def test_a_forked_child_does_not_keep_the_lock(short_tmp):
    """A publisher's process forks (a fork-started pool, a DataLoader) and then stops publishing: the child's copy
    of the lock does not keep others from publishing."""
    publisher = join(short_tmp, "k", Deadline(5))
    assert isinstance(publisher, Publisher)
    child = os.fork()
    if child == 0:
        time.sleep(5)
        os._exit(0)
    try:
        publisher.close()
        again = join(short_tmp, "k", Deadline(2))
        assert isinstance(again, Publisher)
        again.close()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


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
