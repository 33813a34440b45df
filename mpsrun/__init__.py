"""mpsrun: share one NVIDIA GPU among many processes through a private CUDA MPS daemon.

Public API::

    from mpsrun import mps_session
    with mps_session(gpu=0) as session:
        ...  # workers started here are MPS clients of this session's server
"""

from mpsrun.errors import (
    CommandNotFoundError,
    ConfigError,
    DaemonError,
    DaemonStartError,
    DaemonTimeoutError,
    GPUError,
    GPUNotFoundError,
    MPSError,
    MPSUnavailableError,
    NoDriverError,
    NotMPSClientError,
    TeardownError,
    UnsafeDirectoryError,
)
from mpsrun.session import Session, mps_session

__version__ = "0.1.0"

__all__ = [
    "CommandNotFoundError",
    "ConfigError",
    "DaemonError",
    "DaemonStartError",
    "DaemonTimeoutError",
    "GPUError",
    "GPUNotFoundError",
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
