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
from helpers import PATHS, gpu_job_argv, run_job, settle

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
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
tensor = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(tensor)
os.write(1, f"sum {tensor.sum().item() / 4}\\n".encode())  # one write: ranks share stdout, unbuffered or not
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


SHOW_XLA = "import os; os.write(1, f\"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')}\\n\".encode())"


@pytest.mark.parametrize(("path", "options", "callers", "expected"), [
    *((path, [], None, "0.187") for path in PATHS),  # four ranks share the GPU: JAX's 75% split (rounded down)
    ("local", ["--mem-limit", "1G"], None, "None"),  # a limit per rank: mpsrun leaves JAX alone
    ("local", ["--mps", "off"], None, "0.187"),  # time-sliced ranks share the GPU's memory too
    ("mpiexec", [], "0.5", "0.5"),  # the caller's value wins
])
def test_ranks_that_share_a_gpu_split_jaxs_preallocation(path, fake_gpu, monkeypatch, options, callers, expected):
    """Four ranks on one GPU get XLA_PYTHON_CLIENT_MEM_FRACTION 0.75/4, so JAX's preallocation fits them all (each
    took 75% of the GPU, and every rank after the first failed out of memory); not with a memory limit per rank, and
    never over the caller's value."""
    if callers is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", callers)
    out = run_job(path, options, [sys.executable, "-c", SHOW_XLA], ranks=4)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [expected] * 4, out.stdout


#: JAX as its users write it: an array on the GPU, a reduction, with nothing set for JAX's memory.
JAX = """
import os, jax, jax.numpy as jnp
x = jnp.ones((1024, 1024))
os.write(1, f"sum {float((x @ x).sum()) / 1024 ** 3} {jax.devices()[0].platform}\\n".encode())
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_four_jax_ranks_share_one_gpu_without_flags(path, monkeypatch):
    """Four JAX ranks on GPU 0 under MPS, no --mem-limit and no JAX variable set by hand: every rank runs on the GPU
    and is an MPS client (each preallocated 75% of the GPU, and ranks 1-3 failed with CUDA_ERROR_OUT_OF_MEMORY)."""
    pytest.importorskip("jax")
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run(gpu_job_argv(path, ["-v"], [sys.executable, "-c", JAX], ranks=4), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sum", "1.0", "gpu"] * 4, out.stdout
    assert "4 of 4 ranks connected to MPS" in out.stderr, out.stderr


#: Rank 2 fails at once (as a rank out of device memory does); the others wait for the job to stop them.
RANK_2_FAILS = "import os, sys, time\nif os.environ['RANK'] == '2': sys.exit(1)\ntime.sleep(60)\n"


@pytest.mark.parametrize(("path", "options", "free_gib", "hinted"), [
    *[(path, [], 1, True) for path in PATHS],
    ("local", [], 60, False),  # memory to spare: the rank's own exit code says all there is
    ("local", ["--mem-limit", "200M"], 1, False),  # each rank had its limit already
])
def test_a_rank_short_of_shared_memory_is_told_the_limit(fake_gpu, path, options, free_gib, hinted):
    """A rank that fails on a GPU it shares with no memory limit, while less than a rank's share of the GPU is free
    (the others hold more than theirs), is summed up with the GPU's memory and --mem-limit auto, in the one line
    (it was only 'rank 2 exited with code 1 first'); not when memory was left, nor when limits applied."""
    fake_gpu.set_free_memory(free_gib << 30)
    out = run_job(path, options, [sys.executable, "-c", RANK_2_FAILS], ranks=4)
    said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert out.returncode == 1 and len(said) == 1 and "rank 2" in said[0], out.stderr
    hint = "GPU 0 had 1.0 GiB free, less than one rank's share (20.0 GiB) with 4 ranks and no memory limit; if it " \
           "ran out of device memory, --mem-limit auto gives each rank its share"
    assert (hint in said[0]) == hinted, out.stderr
    settle(fake_gpu)


#: Each rank takes a quarter of the GPU's memory and more: the last to ask runs out while the others hold theirs.
GREEDY = """
import os, sys, time
import cupy
free, total = cupy.cuda.runtime.memGetInfo()
if os.environ["RANK"] != "3":
    block = cupy.empty(int(total * 0.3), dtype=cupy.uint8)
    time.sleep(30)
else:
    time.sleep(5)
    block = cupy.empty(int(total * 0.3), dtype=cupy.uint8)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_a_rank_out_of_device_memory_is_told_the_limit(path):
    """Four CuPy ranks on GPU 0, each taking 30% of its memory: the fourth runs out, and the summary says in one
    line that it had less than a rank's share free and that --mem-limit auto gives each rank its share."""
    pytest.importorskip("cupy")
    out = subprocess.run(gpu_job_argv(path, [], [sys.executable, "-c", GREEDY], ranks=4), capture_output=True,
                         text=True, timeout=300)
    said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert out.returncode == 1 and len(said) == 1 and "rank 3" in said[0], out.stderr
    assert "less than one rank's share" in said[0] and "--mem-limit auto" in said[0], out.stderr
