"""The figures of ``--plot`` (``mpsrun bench``, ``mpsrun tune``): matplotlib, drawing to files only."""

from __future__ import annotations

from typing import Any

from mpsrun.errors import MPSError

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no screen is needed); MPSError, in one line, without
    the ``plot`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MPSError("--plot needs matplotlib: pip install 'mpsrun[plot]'") from exc
    return plt
