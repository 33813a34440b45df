"""Nothing of an aborted MPI job is left on the node (issue 36, A): MPICH's shared memory and Hydra's topology file.

MPICH keeps a world's shared memory in /dev/shm/mpich_shm_* until MPI_Finalize, and Hydra's proxy its topology in
/tmp/hydra_hwloc_xmlfile_* until it exits; an MPI_Abort skips both (every aborted job on the mpiexec, per-node and
--hosts paths left one of each; each aborting one-rank world of the local launcher left its own). mpsrun removes
what nobody holds any more once the job (or the node's share of it) is over.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import PATHS, job_argv, settle

from mpsrun.session import leftovers


def test_only_unheld_files_of_this_user_made_since_the_job_began_are_removed(short_tmp):
    """A file nobody holds goes; one a live process holds open, an older one, another user's, and a link (never
    followed: what it names stays) are kept."""
    place = [(str(short_tmp), ("mpich_shm_",))]
    since = time.time()
    loose, held, other, target = (short_tmp / name for name in ("mpich_shm_1_0", "mpich_shm_2_0", "mpich_shm_3_0",
                                                                 "elsewhere"))
    for path in (loose, held, other, target):
        path.write_text("x")
    old = short_tmp / "mpich_shm_old_0"
    old.write_text("x")
    os.utime(old, (since - 3600, since - 3600))
    (short_tmp / "mpich_shm_link_0").symlink_to(target)
    if os.geteuid() == 0:
        os.chown(other, 65534, 65534)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(60)",
                               str(held)])
    try:
        deadline = time.monotonic() + 30
        while not leftovers.holders([str(held)])[str(held)] and time.monotonic() < deadline:
            time.sleep(0.02)
        removed, still = leftovers.sweep(since, place)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [str(loose)]
    assert still == {str(held): {holder.pid}}
    assert old.exists() and target.exists() and (short_tmp / "mpich_shm_link_0").is_symlink()
    assert other.exists() == (os.geteuid() == 0)


def _unheld_since(since: float) -> list[str]:
    """MPI's files made since ``since`` that nobody holds, once jobs of other tests running meanwhile have removed
    theirs (each job removes its own as it ends: at most a few seconds)."""
    deadline = time.monotonic() + 10
    while True:
        left = [path for path, pids in leftovers.holders(leftovers.left_behind(since)).items() if not pids]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


#: Rank 1 of an MPI world raises while the others wait in a barrier (the world's rank 0 under the local launcher,
#: where every rank is a world of its own).
RAISES = """
import os, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == (1 if comm.Get_size() > 1 else 0) and os.environ["RANK"] in ("1", "2"):
    raise ValueError("rank failed")
time.sleep(30)
"""


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_an_aborted_mpi_job_leaves_nothing(fake_gpu, path):
    """An mpi4py rank raises: mpi4py's runner calls MPI_Abort, and once the job is over neither MPICH's shared memory
    nor Hydra's topology file of it is left, on every path."""
    pytest.importorskip("mpi4py")
    since = time.time()
    out = subprocess.run(job_argv(path, ["--grace", "1"], [sys.executable, "-c", RAISES]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert settle(fake_gpu)
    assert _unheld_since(since) == []
