"""``--gpu-bind none`` (one daemon, every rank sees every job GPU) and ``--mem-limit auto``, on every path.

Measured first: a 2-rank job on 2 GPUs whose ranks choose ``Device(local_rank)`` failed on
rank 1 (each rank saw one GPU). And JAX ranks preallocate 75% of what they see as free, so
4 of them cannot share a GPU without a per-rank limit.
"""

import json
import re
import subprocess
import sys

import pytest
from helpers import PATHS, fake, reports, run_job, settle

from mpsrun import mps_session
from mpsrun.errors import ConfigError
from mpsrun.mps.limits import auto_mem_limit

GIB = 1 << 30


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_one_gpu_per_rank_breaks_codes_that_pick_their_device(fake_gpu, short_tmp):
    """The failure measured on the H100, reproduced: by default rank 1 sees one GPU, so Device(1) does not exist."""
    out = run_job("local", [], fake("--device", "local"), ranks=2)
    assert out.returncode == 1 and "invalid device ordinal" in out.stderr, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.parametrize(("ranks", "device"), [(2, "local"), (4, "local%2")])
def test_gpu_bind_none_serves_every_gpu_from_one_daemon(fake_gpu, short_tmp, path, ranks, device):
    """--gpu-bind none: 2 ranks on Device(local_rank), 4 on Device(local_rank % 2), each an MPS client on the GPU
    it chose, all of one daemon, seeing both GPUs; the memory limit names both devices; -v proves every rank."""
    out = run_job(path, ["-v", "--gpu-bind", "none", "--mem-limit", "2G"],
              fake("--device", device, "--report-dir", str(short_tmp)), ranks=ranks)
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert sorted(seen) == list(range(ranks))
    assert len({r["env"]["CUDA_MPS_PIPE_DIRECTORY"] for r in seen.values()}) == 1  # one daemon
    for report in seen.values():
        local = int(report["env"]["LOCAL_RANK"])
        assert report["mps"] and report["uuid"] == fake_gpu.uuids[local % 2], report
        assert report["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(fake_gpu.uuids)
        assert report["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2G,1=2G"
    assert re.search(rf"{ranks} of {ranks} ranks connected to MPS$", out.stderr, re.M), out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_gpu_bind_none_in_the_api(fake_gpu):
    """mps_session(gpus=[0, 1], gpu_bind='none'): one daemon over both GPUs, one env for every worker, exported."""
    import os

    with mps_session(gpus=[0, 1], gpu_bind="none") as session:
        assert len(session.daemons) == 1 and session.daemons[0].devices == ",".join(fake_gpu.uuids)
        assert session.env(0) == session.env(3) == session.env()
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(fake_gpu.uuids)
        child = subprocess.run(fake("--device", "1", "--report", "/dev/stdout"), capture_output=True, text=True,
                               check=True)
        assert json.loads(child.stdout)["uuid"] == fake_gpu.uuids[1] and json.loads(child.stdout)["mps"]
        assert [gpu["index"] for gpu in session.status()["gpus"]] == [0, 1]


@pytest.mark.parametrize("path", PATHS)
def test_mem_limit_auto_splits_the_free_memory(fake_gpu, short_tmp, path):
    """--mem-limit auto with 40 GiB free and 4 ranks on the GPU: (40960 - 128) // 4 = 10208 MiB each, in every
    rank's environment, shown with -v."""
    fake_gpu.set_free_memory(40 * GIB)
    out = run_job(path, ["-v", "--mem-limit", "auto"], fake("--report-dir", str(short_tmp)), ranks=4)
    assert out.returncode == 0, out.stderr
    limits = {r["env"].get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") for r in reports(short_tmp).values()}
    assert limits == {"0=10208M"}, limits
    assert "10208M pinned memory (auto)" in out.stderr or path in ("per-node", "hosts"), out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_mem_limit_auto_counts_the_ranks_of_each_gpu(fake_gpu, short_tmp):
    """3 ranks on 2 GPUs (block: 2 on GPU 0, 1 on GPU 1): each GPU's memory is split among its own ranks."""
    fake_gpu.set_free_memory(20 * GIB)
    out = run_job("local", ["--mem-limit", "auto"], fake("--report-dir", str(short_tmp)), ranks=3)
    assert out.returncode == 0, out.stderr
    limits = {rank: r["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for rank, r in reports(short_tmp).items()}
    assert limits == {0: "0=10176M", 1: "0=10176M", 2: "0=20352M"}, limits
    settle(fake_gpu)


def test_mem_limit_auto_refuses_too_many_ranks(fake_gpu):
    """More ranks than the GPU's free memory can hold a context for: one line, exit 2, nothing started."""
    fake_gpu.set_free_memory(4 * GIB)
    out = run_job("local", ["--mem-limit", "auto"], fake(), ranks=8)
    assert out.returncode == 2 and "too little for a CUDA context" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_mem_limit_auto_in_the_api(fake_gpu):
    """mps_session(mem_limit='auto', workers=4) gives each worker its share (the daemon's default in whole
    gigabytes, as MPS stores it); without workers it is refused."""
    fake_gpu.set_free_memory(40 * GIB)
    with mps_session(mem_limit="auto", workers=4) as session:
        assert session.env()["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10208M"
        assert session.daemons[0].command("get_default_device_pinned_mem_limit 0") == "9G"
    with pytest.raises(ConfigError, match="needs workers=N"):
        mps_session(mem_limit="auto")


@pytest.mark.parametrize(("free_mib", "ranks", "expected"), [(81920, 1, 81792), (81920, 8, 10224),
                                                             (80052, 4, 19981), (1500, 1, 1372)])
def test_auto_mem_limit_formula(free_mib, ranks, expected):
    """Free memory less the server's 128 MiB, split among the ranks (each limit counts its rank's context)."""
    assert auto_mem_limit(free_mib << 20, ranks) == expected


SHOW_QUEUES = "import os; os.write(1, (str(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')) + '\\n').encode())"


@pytest.mark.parametrize("path", PATHS)
def test_each_mps_rank_gets_the_queues_asked_for_else_the_callers(path, fake_gpu, monkeypatch):
    """Four ranks under MPS: without --queues none is set (MPS's default) and a caller's own value reaches them
    unchanged; --queues auto gives each 8 (their server's budget allows a plain process's) and --queues 5 gives 5,
    over the caller's value, on every path."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for options, expected in ((["--mps", "on"], "None"), (["--mps", "on", "--queues", "auto"], "8")):
        out = run_job(path, options, [sys.executable, "-c", SHOW_QUEUES], ranks=4)
        assert out.returncode == 0 and out.stdout.splitlines() == [expected] * 4, out.stderr
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "3")
    for options, expected in ((["--mps", "on"], "3"), (["--mps", "on", "--queues", "5"], "5")):
        out = run_job(path, options, [sys.executable, "-c", SHOW_QUEUES], ranks=4)
        assert out.returncode == 0 and out.stdout.splitlines() == [expected] * 4, out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_queues_without_mps_set_nothing_and_say_so(path, fake_gpu, monkeypatch):
    """--mps off --queues 8: no rank is an MPS client, so none gets CUDA_DEVICE_MAX_CONNECTIONS from mpsrun (a caller's
    own 3 reaches them unchanged), and mpsrun warns that --queues has no effect without MPS, as it does of
    --priority (it said nothing, and the queues asked for were dropped silently), on every path."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for caller, expected in ((None, "None"), ("3", "3")):
        if caller is not None:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", caller)
        out = run_job(path, ["--mps", "off", "--queues", "8"], [sys.executable, "-c", SHOW_QUEUES], ranks=2)
        assert out.returncode == 0 and out.stdout.splitlines() == [expected] * 2, out.stderr
        said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
        assert said and set(said) == {"mpsrun: warning: --queues has no effect without MPS"}, out.stderr
    settle(fake_gpu)
