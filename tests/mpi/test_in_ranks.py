"""Tests that run INSIDE the ranks of a real MPI job started by mpsrun (pytest-mpi, --with-mpi).

tests/test_mpi_tier.py starts them as
``mpsrun -np N --gpus all --launcher mpiexec python -m pytest --with-mpi tests/mpi`` on the
fake machine (two fake GPUs). Without --with-mpi (a plain pytest run) they are skipped.
"""

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_world_matches_mpsrun(comm):
    """mpi4py sees the whole job: size and rank agree with the variables mpsrun gave the rank."""
    assert comm.size == int(os.environ["WORLD_SIZE"])
    assert comm.rank == int(os.environ["RANK"])


def test_collectives_work(comm):
    """An allreduce and an allgather across all ranks give the expected values."""
    assert comm.allreduce(comm.rank + 1) == comm.size * (comm.size + 1) // 2
    assert comm.allgather(comm.rank) == list(range(comm.size))


def test_local_rank_and_gpu_mapping(comm):
    """LOCAL_RANK is the rank on this node, and --map-by block spreads ranks evenly over the two GPUs."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert int(os.environ["LOCAL_RANK"]) == node.rank
    gpus = json.loads(Path(os.environ["MPSRUN_FAKE_NVML"], "gpus.json").read_text())
    expected = gpus[comm.rank * len(gpus) // comm.size]["uuid"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
    pipes = comm.allgather(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    assert len(set(pipes)) == min(comm.size, len(gpus))


def test_each_rank_is_an_mps_client_of_its_gpu():
    """The rank's (fake) CUDA initialisation reaches its GPU's private daemon: an MPS client, right GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fake_mps"))
    import fakecuda

    context = fakecuda.init()
    assert context.mps is True
    assert context.uuid == os.environ["CUDA_VISIBLE_DEVICES"]
