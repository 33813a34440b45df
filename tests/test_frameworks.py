"""Frameworks start as under their own launchers (issue 26, B): torch.distributed's ``env://`` rendezvous.

torchrun gives every rank ``MASTER_ADDR`` (rank 0's host) and ``MASTER_PORT`` (one port for the job); mpsrun
set neither, so ``init_process_group(init_method="env://")`` failed on every path. A rank program that meets
at that address with plain sockets stands in for torch in CI; the GPU tier runs torch itself (gloo, CUDA
tensors, four ranks on one GPU under MPS).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import PATHS, gpu_job_argv, run_job

#: Rank 0 listens at MASTER_ADDR:MASTER_PORT; every other rank connects and says who it is.
MEET = """
import os, socket, time
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if rank == 0:
    with socket.create_server(address) as server:
        seen = []
        for _ in range(size - 1):
            conn, _ = server.accept()
            with conn:
                seen.append(int(conn.recv(16)))
    print("rank 0 met", sorted(seen), flush=True)
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(address, timeout=5) as conn:
                conn.sendall(str(rank).encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
"""

SHOW = "import os; os.write(1, f\"{os.environ.get('MASTER_ADDR')} {os.environ.get('MASTER_PORT')}\\n\".encode())"

#: torch.distributed as a torchrun user writes it: gloo over env://, a CUDA tensor all-reduced.
TORCH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
tensor = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(tensor)
print("sum", tensor.sum().item() / 4, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("path", PATHS)
def test_ranks_meet_at_master_addr_and_port(path, fake_gpu, monkeypatch):
    """Every rank gets the same MASTER_ADDR and MASTER_PORT, and rank 0 can be reached there by the others."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    out = run_job(path, [], [sys.executable, "-c", MEET], ranks=3)
    assert out.returncode == 0, out.stderr
    assert "rank 0 met [1, 2]" in out.stdout


@pytest.mark.parametrize("path", PATHS)
def test_the_callers_master_variables_win(path, fake_gpu, monkeypatch):
    """MASTER_ADDR and MASTER_PORT the caller set reach every rank unchanged."""
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29511")
    out = run_job(path, [], [sys.executable, "-c", SHOW], ranks=2)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["10.1.2.3 29511"] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_torch_distributed_gloo_over_env_on_one_gpu(path, monkeypatch):
    """Four ranks on GPU 0 under MPS: torch.distributed gloo with init_method env:// and no variable set by hand
    all-reduces CUDA tensors, and every rank is an MPS client."""
    pytest.importorskip("torch")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    argv = gpu_job_argv(path, ["-v"], [sys.executable, "-c", TORCH], ranks=4)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sum", "10.0"] * 4, out.stdout
    assert "4 of 4 ranks connected to MPS" in out.stderr, out.stderr


#: Rank 1 fails; rank 0, when stopped, signals its own supervisor, as Open MPI's mpiexec SIGTERMs every
#: remaining rank process once one has failed.
LAUNCHER_ENDS_THE_REST = """
import os, signal, sys, time
if os.environ["RANK"] == "0":
    def stopped(number, frame):
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(1)
        sys.exit(143)
    signal.signal(signal.SIGTERM, stopped)
    open(os.path.join(sys.argv[1], "ready"), "w").close()
    time.sleep(60)
else:
    while not os.path.exists(os.path.join(sys.argv[1], "ready")):
        time.sleep(0.02)
    sys.exit(3)
"""


@pytest.mark.parametrize("path", PATHS)
def test_no_false_interrupt_when_the_launcher_ends_a_failed_job(path, fake_gpu, short_tmp):
    """A rank fails (JAX out of memory, say) and the launcher then SIGTERMs the other ranks' supervisors: the job
    ends with the failed rank's code and names it, and mpsrun does not say it received a SIGTERM (it did, on the
    H100 under Open MPI)."""
    out = run_job(path, [], [sys.executable, "-c", LAUNCHER_ENDS_THE_REST, str(short_tmp)], ranks=2)
    assert out.returncode == 3, out.stderr
    assert "rank 1" in out.stderr and "exited with code 3" in out.stderr, out.stderr
    assert "received SIGTERM" not in out.stderr, out.stderr
