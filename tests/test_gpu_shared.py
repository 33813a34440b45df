"""GPU tier: mpsrun.shared.api with the real MPS daemon, CuPy and cuda.core's IPC memory pools."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MIB = 1 << 20
RANK = """
import json, os, sys, time
from pathlib import Path
import cupy
from mpsrun import shared
rank, sync = os.environ["RANK"], Path(os.environ["SYNC"])
n = int(os.environ["ELEMENTS"])
fill = lambda out: out.__setitem__(Ellipsis, cupy.arange(n, dtype=cupy.float32))
if os.environ["WAY"] == "shared":
    table = shared.array("gpu-table", (n,), "float32", init=fill)
else:
    table = cupy.arange(n, dtype=cupy.float32)
assert cupy.from_dlpack(table).data.ptr == table.__cuda_array_interface__["data"][0] == table.data.ptr  # zero-copy
sample = table[:: max(1, n // 4096)]
checksum = float(cupy.sum(sample.astype(cupy.float64)))
role = shared.role("gpu-table") if os.environ["WAY"] == "shared" else "own"
(sync / f"{rank}.json").write_text(json.dumps({"rank": int(rank), "checksum": checksum, "role": role}))
if os.environ.get("KILL_RANK") == rank:
    os.kill(os.getpid(), 9)
while not (sync / "go").exists():
    time.sleep(0.01)
"""


def used_mib():
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / MIB
    finally:
        pynvml.nvmlShutdown()


def shared_job(tmp_path, ranks, way, elements, kill_rank=None, gpus="0"):
    """Run the ranks on GPU 0 until they all hold the table; the reports, the device memory then, the exit code.
    (Ranks on several GPUs get one copy per GPU: tests/test_shared.py checks that with two fake GPUs.)"""
    sync = tmp_path / f"{way}-{ranks}-{kill_rank}"
    sync.mkdir()
    env = {**os.environ, "SYNC": str(sync), "WAY": way, "ELEMENTS": str(elements)}
    if kill_rank is not None:
        env["KILL_RANK"] = str(kill_rank)
    proc = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", str(ranks), "--gpus", gpus, "--launcher", "local",
                             "--grace", "2", sys.executable, "-c", RANK], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(list(sync.glob("*.json"))) < ranks and proc.poll() is None:
        assert time.monotonic() < deadline, "the ranks did not get the table"
        time.sleep(0.05)
    held = used_mib()
    (sync / "go").write_text("")
    _, err = proc.communicate(timeout=240)
    reports = [json.loads(p.read_text()) for p in sync.glob("*.json")]
    return reports, held, proc.returncode, err


def settled_mib(baseline, deadline=30.0):
    """The device's used memory once it is back near ``baseline`` (or after ``deadline``)."""
    end = time.monotonic() + deadline
    while (now := used_mib()) > baseline + 64 and time.monotonic() < end:
        time.sleep(0.2)
    return now


@pytest.mark.parametrize("ranks", [4, 16])
def test_ranks_read_identical_data_from_one_copy(tmp_path, ranks):
    """4 and 16 CuPy ranks under MPS: one rank fills the table, the others map it; every rank reads the same data,
    and the device holds the table once (against every rank holding its own copy, measured the same way)."""
    elements = 256 * MIB // 4  # a 256 MiB table
    baseline = used_mib()
    shared_reports, shared_used, code, err = shared_job(tmp_path, ranks, "shared", elements)
    assert code == 0, err
    assert len({r["checksum"] for r in shared_reports}) == 1 and len(shared_reports) == ranks
    assert sorted(r["role"] for r in shared_reports).count("publisher") == 1
    settled_mib(baseline)
    own_reports, own_used, code, err = shared_job(tmp_path, ranks, "own", elements)
    assert code == 0, err
    assert {r["checksum"] for r in own_reports} == {shared_reports[0]["checksum"]}
    # Own copies cost (ranks - 1) tables more than one shared copy; allow 20% for the pools' rounding.
    assert own_used - shared_used >= 0.8 * (ranks - 1) * 256, (own_used, shared_used)
    assert shared_used - baseline < own_used - baseline - 0.8 * (ranks - 1) * 256


@pytest.mark.parametrize("killed", [0, 1])
def test_a_sigkilled_exporter_or_importer_leaves_nothing(tmp_path, killed):
    """The rank that filled the table (0) or one that mapped it (1) is SIGKILLed: the job fails with 137, and the
    device memory, the processes and the session directory are all gone afterwards."""
    baseline = used_mib()
    _, _, code, err = shared_job(tmp_path, 4, "shared", 256 * MIB // 4, kill_rank=killed)
    assert code == 137, err
    assert settled_mib(baseline) <= baseline + 64
    leftovers = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "nvidia-cuda-mps-control -f" not in leftovers and "SYNC" not in leftovers
    root = Path(os.environ.get("MPSRUN_TMPDIR") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"mpsrun-{os.getuid()}"
    assert not root.exists() or not any(root.iterdir())


def fill_on_gpu_and_sum(_):
    import cupy

    from mpsrun import shared

    table = shared.array("pool-table", (1 << 20,), "float32",
                         init=lambda out: out.__setitem__(Ellipsis, cupy.ones(1 << 20, dtype=cupy.float32)))
    return os.getpid(), float(table.sum()), shared.role("pool-table")


def test_it_works_under_mps_session_with_a_spawn_pool():
    """The workers of an mps_session() spawn pool share one table: one of them fills it, all read it."""
    import multiprocessing

    from mpsrun import mps_session

    with mps_session(gpu=0), multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(fill_on_gpu_and_sum, range(8))
    assert {total for _, total, _ in results} == {float(1 << 20)}
    roles = {pid: role for pid, _, role in results}
    assert list(roles.values()).count("publisher") == 1


OUTLIVES = """
import os, sys, time
import cupy
from mpsrun import shared
n = 64 << 20
table = shared.array("outlives", (n,), "float32", init=lambda out: out.__setitem__(Ellipsis, cupy.arange(n, dtype=cupy.float32)))
role = shared.role("outlives")
mapped = os.path.join(sys.argv[1], "mapped")
if role == "publisher":  # the rank that filled it ends first, once the other has mapped it (not before: the
    deadline = time.monotonic() + 120  # other would then find no copy and fill its own)
    while not os.path.exists(mapped) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(0)
open(mapped, "w").close()
time.sleep(3)
expected = cupy.arange(n, dtype=cupy.float32)
print("ok" if bool((table == expected).all()) else "changed", flush=True)
"""


def test_the_memory_outlives_the_rank_that_filled_it(tmp_path):
    """Under MPS, the rank that filled the table exits while another still maps it: the other reads the same data
    3 s later (the driver counts the mappings; the first process's exit does not free the memory)."""
    out = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "2", "--gpus", "0", "--launcher", "local",
                          sys.executable, "-c", OUTLIVES, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"], out.stdout


def test_each_gpu_gets_one_copy(tmp_path):
    """4 ranks over two GPUs: one rank per GPU fills the table, the other on that GPU maps it; all read the same."""
    import pynvml

    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() < 2:
            pytest.skip("needs two GPUs")
    finally:
        pynvml.nvmlShutdown()
    reports, _, code, err = shared_job(tmp_path, 4, "shared", 64 * MIB // 4, gpus="0,1")
    assert code == 0, err
    assert sorted(r["role"] for r in reports) == ["publisher", "publisher", "subscriber", "subscriber"]
    assert len({r["checksum"] for r in reports}) == 1
