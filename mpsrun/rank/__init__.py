"""The rank supervisor: the process every rank of every job runs under, on every path.

Owns: a rank's place in the job as launchers and batch systems tell it (:mod:`~mpsrun.rank.identity`),
joining the job's controller (:mod:`~mpsrun.rank.join`), running the rank's command under the job's
rules (:mod:`~mpsrun.rank.supervisor`) in the environment its welcome gives (:mod:`~mpsrun.rank.environ`),
and the variant the local launcher forks (:mod:`~mpsrun.rank.forked`).

Imports: the standard library, :mod:`mpsrun.runtime`, :mod:`mpsrun.errors` and :mod:`mpsrun.exitcodes`
only. Under an MPI launcher one supervisor starts per rank with ``python -S`` (no site-packages), so
nothing else could be imported there; ``tests/test_layout.py`` holds that contract. The one exception is
:mod:`~mpsrun.rank.pyrun`, which runs in the rank's own interpreter (with its site-packages) and imports
mpi4py's runner there.
"""
