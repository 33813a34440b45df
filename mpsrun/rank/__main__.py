"""``python -m mpsrun.rank``: one rank's supervisor (see :mod:`mpsrun.rank.cli` and :mod:`mpsrun.rank.supervisor`)."""

from mpsrun.rank.cli import main
from mpsrun.runtime.processes import exit_now

exit_now(main())
