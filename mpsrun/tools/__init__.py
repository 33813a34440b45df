"""The subcommands that are not a job: ``mpsrun bench`` and ``mpsrun doctor``.

Owns: the side-by-side benchmark (:mod:`~mpsrun.tools.bench`, with its GPU work in
:mod:`~mpsrun.tools.benchwork`), the machine check (:mod:`~mpsrun.tools.doctor`) and the figures of
``--plot`` (:mod:`~mpsrun.tools.plotting`, which ``mpsrun tune`` draws with too).

Imports: anything below it; nothing imports it but the command line and :mod:`mpsrun.tuning`.
"""
