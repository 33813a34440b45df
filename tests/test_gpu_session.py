"""GPU tier: mps_session() with the real nvidia-cuda-mps-control on a real GPU.

Run on a GPU machine with ``pytest -m gpu``; set ``MPSRUN_REQUIRE_GPU=1`` so a missing
GPU fails instead of skipping. These tests are the proof that the fake daemon used by
the CPU tiers tells the truth.
"""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mpsrun import NotMPSClientError, mps_session

pytestmark = pytest.mark.gpu


def mps_processes_of(root: Path) -> list[psutil.Process]:
    """Every nvidia-cuda-mps-* process whose environment points into ``root`` (read, never killed)."""
    found = []
    for proc in psutil.process_iter(["name", "environ"]):
        name = proc.info["name"] or ""
        env = proc.info["environ"] or {}
        if name.startswith("nvidia-cuda-mps") and str(root) in env.get("CUDA_MPS_PIPE_DIRECTORY", ""):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def test_session_on_gpu0_is_active_and_leaves_nothing():
    """A real session on GPU 0 reaches ACTIVE; afterwards no MPS process of ours and no directory remain."""
    with mps_session(gpu=0, mps="on") as session:
        root = session.dirs.root
        entry = session.status()["gpus"][0]
        assert entry["daemon_alive"]
        assert list(entry["servers"].values()) == ["ACTIVE"]
        ours = mps_processes_of(root)
        assert {p.pid for p in ours} >= {entry["daemon_pid"], *entry["servers"]}
    assert not root.exists()
    assert mps_processes_of(root) == []


def _cupy_worker(n):
    """Runs in a spawned pool worker: a real CuPy kernel, result checked on the host."""
    import cupy

    x = cupy.arange(n, dtype=cupy.float64)
    total = float((x * 2.0).sum())
    cupy.cuda.Device().synchronize()
    return os.getpid(), total


def test_spawn_workers_run_cupy_and_are_verified_clients():
    """Four multiprocessing (spawn) workers run CuPy kernels; verify() confirms each is our MPS client."""
    n = 1 << 20
    with mps_session(gpu=0, mps="on") as session:
        pool = multiprocessing.get_context("spawn").Pool(4)
        try:
            results = pool.map(_cupy_worker, [n] * 8, chunksize=2)
            assert all(total == float(n * (n - 1)) for _, total in results)
            workers = [p.pid for p in pool._pool]
            used = {pid for pid, _ in results}
            assert session.verify(workers) == sorted(used)
            assert used <= session.clients()
        finally:
            pool.close()
            pool.join()


def test_worker_pointed_elsewhere_is_caught(tmp_path):
    """A process whose CUDA_MPS_PIPE_DIRECTORY points elsewhere runs without MPS; verify() names it."""
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()
    code = "import cupy, sys, time; cupy.zeros(1).sum(); print('ready', flush=True); time.sleep(60)"
    with mps_session(gpu=0, mps="on") as session:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(elsewhere)}
        stray = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert stray.stdout.readline().strip() == "ready"
            with pytest.raises(NotMPSClientError) as info:
                session.verify([stray.pid])
            assert info.value.pids == [stray.pid]
        finally:
            stray.kill()
            stray.wait()
            stray.stdout.close()


def test_body_exception_propagates_and_teardown_happens():
    """The with-body's exception propagates unchanged and the real daemon and directory are gone."""

    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="body"), mps_session(gpu=0, mps="on") as session:
        root = session.dirs.root
        raise Boom("body")
    assert not root.exists()
    assert mps_processes_of(root) == []


def test_limits_reach_the_server_and_clients():
    """thread_percentage and mem_limit become daemon defaults and the workers' variables."""
    with mps_session(gpu=0, mps="on", thread_percentage=50, mem_limit="4G") as session:
        daemon = session.daemons[0]
        server = daemon.server_list()[0]
        assert float(daemon.command(f"get_active_thread_percentage {server}")) == 50.0
        assert daemon.command("get_default_device_pinned_mem_limit 0") == "4G"
        code = (
            "import cupy; free, total = cupy.cuda.runtime.memGetInfo(); "
            "print(free / 2**30, total / 2**30)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        free, total = map(float, out.stdout.split())
        assert free < 4.0 < total  # the pinned limit shows in free memory, not total
