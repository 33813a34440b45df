"""A job's settings: each option declared once, each value validated once, the JobConfig they make.

Owns: the declarations of every option with its ``MPSRUN_*`` variable (:mod:`~mpsrun.config.options`), the
validation of every value a user can give, on the command line or to the Python API
(:mod:`~mpsrun.config.values`), and reading a command line into a
:class:`~mpsrun.config.options.JobConfig` (:mod:`~mpsrun.config.commandline`).

Imports: the standard library, :mod:`mpsrun.errors` and :mod:`mpsrun.exitcodes` only.
"""
