"""A Python rank alone in its MPI world while the job has more ranks says so once, with the cause and the way out.

With mpi4py installed and no mpiexec on PATH, the default launcher is the local one, which starts every rank as an
MPI world of its own: an all-reduce of 2 ranks gave each its own value (``rank 0/1 RANK=1 sum=1``), and a program
meant to fail in rank 1 exited 0, with nothing said but ``-v``'s ``local launcher``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import job_argv, settle

from mpsrun.rank.pyrun import WorldWatch

pytest.importorskip("mpi4py")

ALLREDUCE = ("import os\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
             "print(f'rank {c.Get_rank()}/{c.Get_size()} RANK={os.environ[\"RANK\"]} sum={c.allreduce(1)}')\n")
ALONE = "mpsrun: rank 0 is alone in its MPI world (1 process, WORLD_SIZE=3): "


def ours(stderr: str) -> list[str]:
    """mpsrun's lines about the MPI world."""
    return [line for line in stderr.splitlines() if "MPI world" in line]


def test_the_local_launcher_asked_for_is_named(fake_gpu):
    """--launcher local with mpiexec on PATH: rank 0 says once that each rank is an MPI world of its own because
    of --launcher local, and to leave it out; the ranks run on."""
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", ALLREDUCE]), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("rank 0/1") == 3 and out.stdout.count("sum=1") == 3, out.stdout  # each alone, as said
    assert ours(out.stderr) == [ALONE + "--launcher local starts each rank as an MPI world of its own; for one world "
                                "of 3 ranks, leave it out"], out.stderr
    settle(fake_gpu)


def test_no_mpiexec_on_path_is_named(fake_gpu, monkeypatch):
    """No mpiexec or mpirun on PATH (the default then is the local launcher): the line says so, and to put an MPI's
    mpiexec on PATH."""
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (os.path.exists(os.path.join(p, "mpiexec"))
                                                       or os.path.exists(os.path.join(p, "mpirun")))))
    out = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "3", sys.executable, "-c", ALLREDUCE],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ours(out.stderr) == [ALONE + "no mpiexec or mpirun is on PATH, so the local launcher started each rank as "
                                "an MPI world of its own; for one world of 3 ranks, put an MPI's mpiexec on PATH "
                                "(pip install mpich)"], out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_one_world_says_nothing(fake_gpu):
    """Under mpiexec the ranks share one world: nothing is said, and the all-reduce sums every rank."""
    out = subprocess.run(job_argv("mpiexec", [], [sys.executable, "-c", ALLREDUCE]), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert ours(out.stderr) == [] and out.stdout.count("sum=3") == 3, out.stderr
    settle(fake_gpu)


def test_a_program_without_mpi_is_not_looked_at(fake_gpu):
    """A program that never imports mpi4py.MPI: nothing is said (MPI is not started for it), nor for one rank."""
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", "import mpi4py"]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and ours(out.stderr) == [], out.stderr
    out = subprocess.run(job_argv("local", [], [sys.executable, "-c", ALLREDUCE], ranks=1), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and ours(out.stderr) == [], out.stderr
    settle(fake_gpu)


def test_another_mpi_than_the_launchers_is_named():
    """Under an MPI launcher a rank alone in its world has mpi4py built for another MPI than the launcher's: the
    cause names mpi4py's MPI and the way out."""
    watch = WorldWatch("mpi", 4)
    assert watch._why("MPICH Version: 4.3.0") == (
        "mpi4py's MPI (MPICH Version: 4.3.0) is not the one whose launcher started the ranks; start them with its "
        "mpiexec (--mpiexec PATH), or use an mpi4py built for the launcher's MPI")
