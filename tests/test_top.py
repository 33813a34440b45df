"""``mpsrun top`` (issue 38): this user's running jobs on this node, a row per rank and per GPU, read from the
sessions' records, the ranks' environments, psutil and NVML; it never changes a job. With the fake GPU, whose NVML
lists each client's memory as the H100's did."""

import json
import os
import signal
import subprocess
import sys
import time

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
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err == "", err
    assert out.count("mpsrun top - ") >= 2


def test_top_with_no_jobs_says_so(fake_gpu):
    """No running job: the header says 0 jobs, and the GPU's row is there."""
    out = _top("--once")
    assert out.returncode == 0 and "0 job(s), 0 rank(s)" in out.stdout.splitlines()[0], out
    assert sys.executable and os.environ.get("MPSRUN_FAKE_NVML")


def test_a_hosts_jobs_controller_shows_the_other_hosts_ranks(fake_gpu, short_tmp, monkeypatch):
    """Under --hosts the job's controller publishes each rank's host, pid and peak (the node keepers send their peaks
    up), and top on its host shows the ranks of the other hosts from it (here the host is named otherwise, so the
    ranks of localhost read as another host's)."""
    from mpsrun.tools import top

    job = _running("hosts", short_tmp)
    try:
        _ranks_seen(3)
        monkeypatch.setattr(top.socket, "gethostname", lambda: "not-this-host")

        def remote() -> list | None:
            rows = [r for r in top.Top().snapshot().ranks if r.state == "remote" and r.peak]
            return rows if len(rows) == 3 else None

        rows = wait_for(remote, timeout=60, what="the other host's ranks")
        shown = top.render(top.Top().snapshot())
    finally:
        _end(job, short_tmp)
    assert [(r.rank, r.peak) for r in rows] == [(i, held + CONTEXT_MIB) for i, held in enumerate(HELD)]
    assert all(r.host != "not-this-host" and r.pid > 0 for r in rows)
    assert sum(line.split()[-2:-1] == ["remote"] for line in shown) == 3, shown
    settle(fake_gpu)
