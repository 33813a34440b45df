"""A job: its ranks placed, started, watched and judged, on every path, under one contract.

Owns: running a job from its configuration (:mod:`~mpsrun.job.runner`); a job's part on one node, which the
``mpsrun`` command and node keepers share (:mod:`~mpsrun.job.nodesession`); placement of ranks on GPUs with
their limits and the one rank environment (:mod:`~mpsrun.job.placement`); the backends that start rank
supervisors, locally or through mpiexec, on one host or several (:mod:`~mpsrun.job.backends`,
:mod:`~mpsrun.job.launch`, :mod:`~mpsrun.job.mpiexec`, :mod:`~mpsrun.job.channel`); the controllers that
apply the job's contract to every rank (:mod:`~mpsrun.job.controller`, :mod:`~mpsrun.job.jobcontroller`,
:mod:`~mpsrun.job.table`); how a job ended and what its end says (:mod:`~mpsrun.job.outcome`,
:mod:`~mpsrun.job.report`).

Imports: :mod:`mpsrun.session`, :mod:`mpsrun.mps`, :mod:`mpsrun.rank`, :mod:`mpsrun.config`,
:mod:`mpsrun.runtime` and the bottom layer; never :mod:`mpsrun.node` (which builds on it).
"""
