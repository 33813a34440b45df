"""The examples say what happened, truthfully (issue 36, B10).

examples/pool.py printed "workers verified as MPS clients: 0" on the fake GPU and called that a check: verify()
passed when no worker held a CUDA context. examples/shared_table.py was silent for 14-15 s on a CPU. The batch
scripts use paths relative to the repository's root without saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import FAKE_CUDA, MPSRUN, ROOT

from mpsrun import mps_session
from mpsrun.errors import NotMPSClientError

HOST_MEMORY = "sharing host memory as read-only NumPy arrays"


def _no_device() -> dict[str, str]:
    """The environment with no CUDA device in sight (on the GPU machine too, where CuPy finds the real one)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _run_example(name, cupy, monkeypatch):
    """examples/NAME run with the CuPy double on the path, or without it (on NumPy)."""
    pytest.importorskip("numpy")
    if cupy:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_CUDA), os.environ["PYTHONPATH"]]))
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("cupy", [True, False])
def test_the_pool_example_counts_only_workers_that_used_the_gpu(fake_gpu, monkeypatch, cupy):
    """With CuPy (the double) every worker that took a task is a GPU client and verified as an MPS client (one to
    four of them: a worker that started first may take every task); without it they run on NumPy, and the example
    says none used the GPU instead of calling zero verified a pass."""
    out = _run_example("pool.py", cupy, monkeypatch)
    assert out.returncode == 0, out.stderr
    said = re.search(r"MPS on; workers on the GPU: (\d+), verified as MPS clients: (\d+)", out.stdout)
    assert said is not None, out.stdout
    on_gpu, verified = int(said[1]), int(said[2])
    assert (on_gpu == verified and 1 <= on_gpu <= 4) if cupy else on_gpu == verified == 0, out.stdout


def test_verify_refuses_to_call_no_client_verified(fake_gpu):
    """verify() of processes none of which holds a CUDA context raises NotMPSClientError naming them: there was
    nothing to verify (it returned an empty list, which reads as a pass)."""
    with mps_session(gpu=0) as session:
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(NotMPSClientError, match="holds a CUDA context") as caught:
                session.verify([idle.pid])
            assert caught.value.pids == [idle.pid]
        finally:
            idle.kill()
            idle.wait()


def test_shared_table_says_what_it_does_before_the_long_part(no_gpu):
    """Rank 0 of examples/shared_table.py says at once what it makes and draws (it was silent for 14-15 s on a
    CPU)."""
    pytest.importorskip("numpy")
    out = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "--tag-output",
                          sys.executable, str(ROOT / "examples" / "shared_table.py"), "--mib", "1", "--samples", "1000"],
                         capture_output=True, text=True, timeout=120)  # whole lines whatever PYTHONUNBUFFERED says
    assert out.returncode == 0, out.stderr
    said = [line.removeprefix("[rank 0] ") for line in out.stdout.splitlines() if line.startswith("[rank 0] rank 0/2:")]
    assert said[0].startswith("rank 0/2: 1 MiB table, made once per GPU (or host) and shared"), said
    assert said[1].startswith("rank 0/2: table of 1 MiB"), said


@pytest.mark.parametrize("script", ["slurm/one_gpu.sbatch", "slurm/all_gpus.sbatch", "slurm/multi_node.sbatch",
                                    "pbs/multi_node.pbs"])
def test_batch_scripts_say_where_they_are_submitted_from(script):
    """Each batch script says it is submitted from the repository's root, where its relative paths lead."""
    text = (ROOT / "examples" / script).read_text()
    assert "Submit it from the repository's root" in text and "examples/" in text


def test_shared_table_says_host_memory_once(no_gpu):
    """examples/shared_table.py with 3 ranks and no GPU: the host-memory notice comes once (it came per rank)."""
    pytest.importorskip("numpy")
    out = subprocess.run([*MPSRUN, "-np", "3", "--launcher", "local", sys.executable,
                          str(ROOT / "examples" / "shared_table.py"), "--mib", "1", "--samples", "1000"],
                         capture_output=True, text=True, timeout=120, env=_no_device())
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(HOST_MEMORY) == 1, out.stderr
    assert len(re.findall(r"rank \d/3: table of 1 MiB", out.stdout)) == 3


def test_per_rank_limits_without_a_gpu_is_one_line(no_gpu):
    """examples/per_rank_limits.py without a GPU: rank 0 says what it needs, once; no traceback (there were two)."""
    out = subprocess.run([*MPSRUN, "-np", "2", "--launcher", "local", sys.executable,
                          str(ROOT / "examples" / "per_rank_limits.py")],
                         capture_output=True, text=True, timeout=120, env=_no_device())
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("needs CuPy and an NVIDIA GPU") == 1, out.stderr


@pytest.mark.parametrize("cupy", [True, False])
def test_the_executor_example_says_how_many_workers_were_mps_clients(fake_gpu, monkeypatch, cupy):
    """examples/executor.py: with CuPy (the double) its four workers are proven MPS clients of the executor's daemon;
    without it they run on NumPy, and it says none was, rather than calling that a pass."""
    out = _run_example("executor.py", cupy, monkeypatch)
    assert out.returncode == 0, out.stderr
    assert "mean of x^2 over 16 tasks: 0.33" in out.stdout, out.stdout
    assert f"MPS on; {4 if cupy else 0} of 4 workers proven MPS clients" in out.stdout, out.stdout
