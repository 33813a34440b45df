"""GPU tier: the mpsrun command with the real MPS daemon, CuPy ranks and the real mpiexec (Open MPI there)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import mpsrun

pytestmark = pytest.mark.gpu
PROBE = Path(__file__).resolve().parent / "programs" / "gpu_probe.py"


def probes(directory):
    return sorted((json.loads(p.read_text()) for p in Path(directory).glob("*.json")), key=lambda p: p["rank"])


@pytest.mark.parametrize("launcher", ["mpiexec", "local"])
def test_four_cupy_ranks_are_verified_mps_clients(launcher, tmp_path, monkeypatch):
    """mpsrun -np 4 with CuPy ranks: every rank is verified as an MPS client; auto gives each 25%."""
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    out = mpsrun("-np", 4, "--gpus", "0", "--mps", "on", "--launcher", launcher, "--thread-percentage", "auto", "-v",
                 sys.executable, PROBE, "--seconds", "4")
    assert out.returncode == 0, out.stderr
    seen = probes(tmp_path)
    assert [p["rank"] for p in seen] == [0, 1, 2, 3]
    for probe in seen:
        assert probe["ok"]
        assert probe["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert probe["env"]["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        if launcher == "mpiexec":
            assert probe["size"] == probe["total"] == 4
    assert "4 of 4 ranks connected to MPS" in out.stderr


def test_mps_off_runs_without_a_daemon(tmp_path, monkeypatch):
    """--mps off: the ranks run (time-sliced) and no MPS client check or daemon is involved."""
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    out = mpsrun("-np", 2, "--mps", "off", "--launcher", "local", "-v", sys.executable, PROBE, "--seconds", "1")
    assert out.returncode == 0, out.stderr
    seen = probes(tmp_path)
    assert len(seen) == 2 and all(p["ok"] and p["env"]["CUDA_MPS_PIPE_DIRECTORY"] is None for p in seen)
    assert "MPS off" in out.stderr and "verified as MPS clients" not in out.stderr


def test_rank_pointed_elsewhere_is_caught(tmp_path):
    """A rank that points CUDA_MPS_PIPE_DIRECTORY elsewhere is named, and --mps on fails with exit 3."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = mpsrun("-np", 2, "--mps", "on", "--launcher", "local", "--grace", "2",
                 "env", f"CUDA_MPS_PIPE_DIRECTORY={elsewhere}", sys.executable, PROBE, "--seconds", "20")
    assert out.returncode == 3, out.stderr
    # Whichever rank is seen first stops the job: the check names it by rank, pid and GPU (on two GPUs rank 1 has
    # GPU 1).
    assert re.search(r"rank [01] \(pid \d+\) uses GPU [01] without MPS", out.stderr), out.stderr


def test_two_gpus_get_a_daemon_each(tmp_path, monkeypatch):
    """With two GPUs, --gpus all --map-by block puts ranks 0-1 on one GPU and 2-3 on the other, each GPU
    with its own daemon, and every rank is verified as a client of its GPU's server."""
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    if count < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    out = mpsrun("-np", 4, "--gpus", "all", "--mps", "on", "--launcher", "local", "-v",
                 sys.executable, PROBE, "--seconds", "4")
    assert out.returncode == 0, out.stderr
    seen = probes(tmp_path)
    gpus = [p["env"]["CUDA_VISIBLE_DEVICES"] for p in seen]
    pipes = [p["env"]["CUDA_MPS_PIPE_DIRECTORY"] for p in seen]
    assert gpus[0] == gpus[1] != gpus[2] == gpus[3]
    assert pipes[0] == pipes[1] != pipes[2] == pipes[3]
    assert "4 of 4 ranks connected to MPS" in out.stderr


def test_two_jobs_at_once_on_one_gpu(tmp_path):
    """Two mpsrun jobs on GPU 0 at the same time: each its own daemon, both finish, all ranks verified."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    jobs = []
    for directory in dirs:
        directory.mkdir()
        env = {**os.environ, "PROBE_DIR": str(directory)}
        jobs.append(subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--gpus", "0", "--mps", "on",
                                      "--launcher", "local", "-v", sys.executable, str(PROBE), "--seconds", "5"],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [job.communicate(timeout=300)[1] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], errors
    assert all("2 of 2 ranks connected to MPS" in err for err in errors)
    pipes = [{p["env"]["CUDA_MPS_PIPE_DIRECTORY"] for p in probes(d)} for d in dirs]
    assert len(pipes[0]) == len(pipes[1]) == 1 and pipes[0] != pipes[1]


def test_per_node_under_mpirun(tmp_path, monkeypatch):
    """mpirun -np 4 mpsrun --per-node: one session for the node (a daemon per GPU: on two GPUs, ranks 0-1 on GPU 0
    and 2-3 on GPU 1), every rank verified, the daemons gone after the last."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun")
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    base = Path(tempfile.mkdtemp(prefix="pn", dir="/tmp"))
    env = {**os.environ, "MPSRUN_TMPDIR": str(base)}
    out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, "-m",
                          "mpsrun", "--per-node", "-v", "--mps", "on", sys.executable, str(PROBE), "--seconds", "4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = probes(tmp_path)
    assert [p["rank"] for p in seen] == [0, 1, 2, 3]
    pipes = {p["env"]["CUDA_MPS_PIPE_DIRECTORY"] for p in seen}
    assert len({Path(pipe).parents[1] for pipe in pipes}) == 1, pipes  # one node session
    assert len(pipes) == len({p["env"]["CUDA_VISIBLE_DEVICES"] for p in seen}), pipes  # a daemon per GPU in use
    assert "4 of 4 ranks connected to MPS" in out.stderr  # from the node keeper, once
    root = base / f"mpsrun-{os.getuid()}"
    assert not root.exists() or list(root.iterdir()) == []
    shutil.rmtree(base, ignore_errors=True)
