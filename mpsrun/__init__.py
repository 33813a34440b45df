"""mpsrun: share one NVIDIA GPU among many processes through a private CUDA MPS daemon.

Public API: ``__all__`` is its one list (its errors are :mod:`mpsrun.errors`' own list); ``tests/test_api.py``
checks the README and that module against it::

    from mpsrun import mps_session
    with mps_session(gpu=0) as session:
        ...  # workers started here are MPS clients of this session's server

    from mpsrun import shared
    table = shared.array("xs-table", (1 << 28,), "float32", init=load_table)  # one copy per GPU
"""

# The errors of __all__ are lazy names, like the others (star-imported below for type checkers only):
# ruff: noqa: F405

__version__ = "0.1.0"

#: The public API, one list. The errors are :mod:`mpsrun.errors`' own list (``tests/test_api.py`` holds the two equal).
__all__ = [
    "CommandNotExecutableError", "CommandNotFoundError", "ConfigError", "DaemonError", "DaemonStartError",
    "DaemonTimeoutError", "Executor", "GPUError", "GPUNotFoundError", "JobTimeoutError", "MPSError",
    "MPSUnavailableError", "NoDriverError", "NotMPSClientError", "Session", "SharedArrayError", "TeardownError",
    "UnsafeDirectoryError", "WorkerDiedError", "__version__", "mps_session", "shared", "tune",
]

#: Where each name other than an error comes from; all are imported on first use (PEP 562): every process of a job
#: imports this package (each rank's supervisor, and each Python rank's runner in the rank's own interpreter), and
#: pays for nothing here.
_LAZY = {"Executor": "mpsrun.farm.executor", "Session": "mpsrun.session.session",
         "mps_session": "mpsrun.session.session",
         "shared": "mpsrun.shared", "tune": "mpsrun.tuning"}

TYPE_CHECKING = False
if TYPE_CHECKING:  # what the lazy names are, for type checkers
    from mpsrun import shared
    from mpsrun.errors import *  # noqa: F403
    from mpsrun.farm.executor import Executor
    from mpsrun.session.session import Session, mps_session
    from mpsrun.tuning import tune


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'mpsrun' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY.get(name, "mpsrun.errors"))
    return module if module.__name__ == f"mpsrun.{name}" else getattr(module, name)
