"""mpsrun: share one NVIDIA GPU among many processes through a private CUDA MPS daemon.

Public API: ``__all__`` is its one list (the public errors are :mod:`mpsrun.errors`' own list, taken in
whole); ``tests/test_api.py`` checks the README against it::

    from mpsrun import mps_session
    with mps_session(gpu=0) as session:
        ...  # workers started here are MPS clients of this session's server

    from mpsrun import shared
    table = shared.array("xs-table", (1 << 28,), "float32", init=load_table)  # one copy per GPU
"""

from typing import Any

from mpsrun import errors
from mpsrun.errors import *  # noqa: F403 - exactly errors.__all__

__version__ = "0.1.0"

__all__ = [*errors.__all__, "Session", "__version__", "mps_session", "shared", "tune"]  # noqa: F405 - lazy names

#: Imported on first use (PEP 562): every rank supervisor imports this package, and should not pay for NVML,
#: psutil and the session machinery it never uses.
_LAZY = {"Session": "mpsrun.session.session", "mps_session": "mpsrun.session.session", "shared": "mpsrun.shared",
         "tune": "mpsrun.tuning"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpsrun' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY[name])
    return module if module.__name__ == f"mpsrun.{name}" else getattr(module, name)
