"""A job: the ``mpsrun`` command's part. It plans the job, starts its agents, and decides for the whole job.

Owns: running a job from its configuration (:mod:`~mpsrun.job.run`: its node's agent in this process, or the hosts'
agents), the hosts' agents as the command hears them (:mod:`~mpsrun.job.hosts`), what starts the ranks' supervisors,
locally or through mpiexec, on one host or several (:mod:`~mpsrun.job.backends`, :mod:`~mpsrun.job.launch`,
:mod:`~mpsrun.job.mpiexec`), and the plan printed by ``--dry-run`` (:mod:`~mpsrun.job.dryrun`).

Imports: :mod:`mpsrun.agent` and everything below it.
"""
