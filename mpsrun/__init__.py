"""mpsrun: share one NVIDIA GPU among many processes through a private CUDA MPS daemon.

Public API::

    from mpsrun import mps_session
    with mps_session(gpu=0) as session:
        ...  # workers started here are MPS clients of this session's server
"""

TYPE_CHECKING = False  # typing's import (3-5 ms) is left out of every rank supervisor's start
if TYPE_CHECKING:
    from typing import Any

    from mpsrun.errors import (
        CommandNotExecutableError,
        CommandNotFoundError,
        ConfigError,
        DaemonError,
        DaemonStartError,
        DaemonTimeoutError,
        GPUError,
        GPUNotFoundError,
        JobTimeoutError,
        MPSError,
        MPSUnavailableError,
        NoDriverError,
        NotMPSClientError,
        TeardownError,
        UnsafeDirectoryError,
    )
    from mpsrun.session.session import Session, mps_session


def __getattr__(name: str) -> "Any":
    # Imported on first use: the command's entry point must take the signals before any
    # import work, and the in-rank shim (python -m mpsrun.rank.supervisor) starts once per rank and
    # should not pay for NVML, psutil and the session machinery.
    if name in ("Session", "mps_session"):
        from mpsrun.session import session

        return getattr(session, name)
    if name in __all__:
        from mpsrun import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'mpsrun' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CommandNotExecutableError",
    "CommandNotFoundError",
    "ConfigError",
    "DaemonError",
    "DaemonStartError",
    "DaemonTimeoutError",
    "GPUError",
    "GPUNotFoundError",
    "JobTimeoutError",
    "MPSError",
    "MPSUnavailableError",
    "NoDriverError",
    "NotMPSClientError",
    "Session",
    "TeardownError",
    "UnsafeDirectoryError",
    "__version__",
    "mps_session",
]
