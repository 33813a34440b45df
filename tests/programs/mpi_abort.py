"""An mpi4py program whose rank 1 calls MPI_Abort(5) while the others wait in a collective."""

import os
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
if int(os.environ.get("RANK", comm.rank)) == 1:
    time.sleep(0.5)
    comm.Abort(5)
comm.Barrier()  # the other ranks of a real MPI world wait here for rank 1, which never comes
time.sleep(30)  # a rank of a one-rank world (the local launcher) waits to be stopped
