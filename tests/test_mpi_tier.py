"""The pytest-mpi tier: tests/mpi runs inside the ranks of real MPI jobs (2 and 4 ranks) launched by mpsrun."""

import os
import shutil
import subprocess
import sys

import pytest
from helpers import TESTS


@pytest.mark.mpiexec
@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.slow
def test_pytest_mpi_suite_inside_mpsrun_ranks(fake_gpu):
    """Every rank runs tests/mpi with --with-mpi and passes: world size, collectives, GPU mapping, MPS client. Four
    ranks on two GPUs cover both a GPU per rank's neighbour and a GPU shared (each rank runs all of pytest, so the
    two-rank run it replaced added nothing but CPU)."""
    ranks = 4
    pytest.importorskip("mpi4py")
    pytest.importorskip("pytest_mpi")
    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    if mpiexec is None:
        pytest.skip("no mpiexec")
    out = subprocess.run(
        [sys.executable, "-m", "mpsrun", "-np", str(ranks), "--gpus", "all", "--launcher", "mpiexec",
         "--mpiexec", mpiexec, "--mps", "on", sys.executable, "-m", "pytest", "--with-mpi", "-q",
         "-p", "no:cacheprovider", "-p", "no:tmpdir", "-o", "addopts=", "--timeout", "120", str(TESTS / "mpi")],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("4 passed") == ranks
