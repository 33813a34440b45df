"""Proof of MPS per rank from the daemon's log, on every path, however briefly a rank lives.

The control daemon run with ``-f`` logs every client the server accepts (recorded on an H100:
tests/data/h100/daemon_stdout.txt), and the fake daemon writes the same lines. Sampling NVML
alone missed ranks that lived less than a watch interval (2 of 4 JAX ranks on the H100).
"""

import re
import subprocess

import pytest
from helpers import PATHS, TESTS, fake, run_job, settle

from mpsrun.agent.findings import verified_line
from mpsrun.mps.replies import connected_clients
from mpsrun.mps.watch import ClientWatcher, RankWatch

RECORDED = TESTS / "data" / "h100" / "daemon_stdout.txt"


def test_the_recorded_log_names_every_connection():
    """The H100 recording: the server's "connected" lines name the same pids, in order, as NEW CLIENT lines."""
    text = RECORDED.read_text()
    new_client = [int(pid) for pid in re.findall(r"NEW CLIENT (\d+) from user", text)]
    assert connected_clients(text) == new_client and new_client[:4] == [8216, 8217, 8216, 8217]


def test_the_fake_daemon_writes_the_real_lines(fake_gpu, short_tmp):
    """A fake client's connection shows in the fake daemon's log in the recorded formats (both lines)."""
    from mpsrun import mps_session

    with mps_session() as session:
        subprocess.run(fake(), env={**__import__("os").environ, **session.env()}, check=True, timeout=30)
        text = session.daemons[0].log_file.read_text()
    new_client = re.findall(r"\] NEW CLIENT (\d+) from user \d+: Server already exists$", text, re.M)
    connected = connected_clients(text)
    assert new_client and [int(p) for p in new_client] == connected
    recorded = RECORDED.read_text()
    assert re.search(r"\] NEW CLIENT \d+ from user \d+: Server already exists$", recorded, re.M)


@pytest.mark.parametrize("path", PATHS)
def test_ranks_that_exit_at_once_are_proven(fake_gpu, path):
    """Three ranks that connect and exit within milliseconds (before the first NVML sample) are each proven."""
    out = run_job(path, ["-v"], fake())
    assert out.returncode == 0, out.stderr
    assert re.search(r"3 of 3 ranks connected to MPS$", out.stderr, re.M), out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_without_cuda_is_named(fake_gpu, path):
    """A rank that never initialises CUDA is reported as such, not as a client and not as a failure."""
    out = run_job(path, ["-v"], fake("--no-cuda-rank", "1"))
    assert out.returncode == 0, out.stderr
    assert "2 of 3 ranks connected to MPS (0,2); no CUDA context seen: rank(s) 1" in out.stderr, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "per-node"])
def test_a_descendant_that_connects_proves_its_rank(fake_gpu, path):
    """A rank whose CUDA work runs in a child process (alive for 3 s) is proven through the child. The watch ties a
    child to its rank while it lives (as the README says): with 1 s, a loaded machine's look came too late (1 in
    about 900 tests)."""
    out = run_job(path, ["-v"], fake("--in-child", "--hold", "3"), ranks=2)
    assert out.returncode == 0, out.stderr
    assert re.search(r"2 of 2 ranks connected to MPS$", out.stderr, re.M), out.stderr
    settle(fake_gpu)


def test_a_rank_without_mps_is_named_in_the_line(fake_gpu, short_tmp):
    """The per-rank line names ranks proven, ranks seen WITHOUT MPS and ranks with no context."""
    watch = RankWatch(ClientWatcher([], []), required=False)
    watch.verified.update({0, 2})
    watch.without_mps.add(3)
    assert verified_line(watch, range(5)) == (
        "2 of 5 ranks connected to MPS (0,2); used the GPU WITHOUT MPS: rank(s) 3; no CUDA context seen: rank(s) 1,4")
    assert verified_line(watch, [0]) == "1 of 1 rank connected to MPS"
