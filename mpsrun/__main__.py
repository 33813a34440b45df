"""``python -m mpsrun``: the same as the ``mpsrun`` command."""

import sys

from mpsrun.cli import main

sys.exit(main())
