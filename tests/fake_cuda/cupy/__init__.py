"""A test double of CuPy for machines without a GPU: the little the examples and ``mpsrun.shared.api`` use, over NumPy.

``from_dlpack`` of a fake ``cuda.core`` buffer gives a NumPy view of its memory (zero-copy, as DLPack is). As real
CuPy does, a process's first array (``arange``, ``zeros``, ``ones``) makes its CUDA context: the fake CUDA program's
(tests/fake_mps/fakecuda.py), a client of the MPS daemon the environment names, else a plain context.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import numpy
from numpy import asarray, float32, float64, int32, int64, ndarray, random, uint8  # noqa: F401 - CuPy's names

cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
_pool = types.SimpleNamespace(free_all_blocks=lambda: None)


@functools.cache
def _context() -> object:
    """This process's fake CUDA context, made once, where the fake NVML can see it."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fake_mps"))
    import fakecuda

    return fakecuda.init()


def _allocating(make):  # type: ignore[no-untyped-def]
    @functools.wraps(make)
    def first_makes_the_context(*args, **kwargs):  # type: ignore[no-untyped-def]
        if os.environ.get("MPSRUN_FAKE_NVML"):
            _context()
        return make(*args, **kwargs)

    return first_makes_the_context


arange, zeros, ones = _allocating(numpy.arange), _allocating(numpy.zeros), _allocating(numpy.ones)


def get_default_memory_pool() -> types.SimpleNamespace:
    return _pool


def from_dlpack(buffer: object) -> numpy.ndarray:
    return numpy.frombuffer(buffer._map, dtype=numpy.uint8)  # type: ignore[attr-defined]
