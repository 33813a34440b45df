"""Shared read-only arrays: one copy per GPU for every rank of a job.

Owns: the API (:mod:`~mpsrun.shared.api`: ``shared.array``, ``shared.release``), handing a region from the
rank that fills it to the others (:mod:`~mpsrun.shared.handoff`), and the memory itself, on the device or
on the host (:mod:`~mpsrun.shared.memory`).

Imports: the standard library, NumPy, CuPy and cuda-core (when there), :mod:`mpsrun.session` (the paths'
limits), :mod:`mpsrun.runtime` and the bottom layer.
"""

from mpsrun.errors import SharedArrayError
from mpsrun.shared.api import DEFAULT_TIMEOUT, array, release, role

__all__ = ["DEFAULT_TIMEOUT", "SharedArrayError", "array", "release", "role"]
