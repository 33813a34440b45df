"""A test double of CuPy for machines without a GPU: the little ``mpsrun.shared.api`` uses, over NumPy.

``from_dlpack`` of a fake ``cuda.core`` buffer gives a NumPy view of its memory (zero-copy, as DLPack is).
"""

from __future__ import annotations

import types

import numpy
from numpy import arange, asarray, float32, float64, int32, int64, ndarray, uint8  # noqa: F401 - CuPy's names

cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
_pool = types.SimpleNamespace(free_all_blocks=lambda: None)


def get_default_memory_pool() -> types.SimpleNamespace:
    return _pool


def from_dlpack(buffer: object) -> numpy.ndarray:
    return numpy.frombuffer(buffer._map, dtype=numpy.uint8)  # type: ignore[attr-defined]
