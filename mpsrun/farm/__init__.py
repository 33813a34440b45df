"""Ensembles: many small tasks on a job's slots (``mpsrun --tasks``, ``--array``).

Owns: the task list (:mod:`~mpsrun.farm.tasks`), the results file and ``--resume`` (:mod:`~mpsrun.farm.results`),
the slots that run one task at a time, retry failed ones and find the culprit of a fatal GPU fault
(:mod:`~mpsrun.farm.farm`), and the command's part of a farm on its node (:mod:`~mpsrun.farm.run`).

Imports: :mod:`mpsrun.job` and everything below it.
"""
