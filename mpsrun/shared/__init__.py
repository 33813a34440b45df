"""Shared read-only arrays: one copy per GPU for every rank of a job (see :mod:`mpsrun.shared.api`)."""

from mpsrun.errors import SharedArrayError
from mpsrun.shared.api import DEFAULT_TIMEOUT, array, release

__all__ = ["DEFAULT_TIMEOUT", "SharedArrayError", "array", "release"]
