"""``python -m mpsrun``: the same as the ``mpsrun`` command."""

import sys

from mpsrun._entry import main

sys.exit(main())
