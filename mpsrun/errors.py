"""Exceptions raised by mpsrun.

Every error derives from :class:`MPSError` and, where one fits, from the matching
builtin (``ValueError``, ``TimeoutError``, ...), so callers can catch either.
Errors carry their data as attributes and survive pickling (they cross process
boundaries in multiprocessing pools). ``__all__`` lists the public ones (the package's public
list includes it); the few below it are mpsrun's own, raised and caught inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpsrun import exitcodes
from mpsrun.exitcodes import ExitCode, signal_name

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
    "SharedArrayError",
    "TeardownError",
    "UnsafeDirectoryError",
    "WorkerDiedError",
]


def _rebuild(cls: type[MPSError], kwargs: dict[str, Any]) -> MPSError:
    return cls(**kwargs)


class MPSError(Exception):
    """Base class of every error mpsrun raises.

    ``exit_code`` is what the ``mpsrun`` command exits with for it (see
    :mod:`mpsrun.exitcodes`): 2 for a usage error, 127 for a missing command, 3 otherwise.
    """

    exit_code: int = ExitCode.SETUP

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self._data = data
        for key, value in data.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), {"message": self.message, **self._data}))

    def __str__(self) -> str:
        return self.message


class ConfigError(MPSError, ValueError):
    """A setting is invalid; raised before anything is started.

    Attributes: ``setting`` (the option or argument name) and ``value``.
    """

    exit_code = ExitCode.USAGE
    setting: str
    value: Any

    def __init__(self, message: str, *, setting: str = "", value: Any = None) -> None:
        super().__init__(message, setting=setting, value=value)


class UnsafeDirectoryError(MPSError, PermissionError):
    """A session directory (or its parent) is not private to this user.

    Attributes: ``path`` and ``reason``.
    """

    path: str
    reason: str

    def __init__(self, message: str, *, path: str = "", reason: str = "") -> None:
        super().__init__(message, path=path, reason=reason)


class GPUError(MPSError, RuntimeError):
    """NVML could not answer a question about the GPUs."""


class NoDriverError(GPUError):
    """No NVIDIA driver (NVML) is usable on this machine. Attribute: ``reason``."""

    reason: str

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message, reason=reason)


class GPUNotFoundError(MPSError, ValueError):
    """A requested GPU is not visible. Attributes: ``requested`` and ``visible``."""

    exit_code = ExitCode.USAGE

    requested: Any
    visible: list[str]

    def __init__(self, message: str, *, requested: Any = None, visible: Sequence[str] = ()) -> None:
        super().__init__(message, requested=requested, visible=list(visible))


class MPSUnavailableError(MPSError, RuntimeError):
    """MPS was required (``mps="on"``) but cannot run here. Attribute: ``reason``."""

    reason: str

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message, reason=reason)


class DaemonError(MPSError, RuntimeError):
    """The MPS control daemon refused or failed a command.

    Attributes: ``command`` (what was sent), ``reply`` (what the daemon printed) and
    ``log_tail`` (the last lines of the daemon's log, when known).
    """

    command: str
    reply: str
    log_tail: str

    def __init__(self, message: str, *, command: str = "", reply: str = "", log_tail: str = "") -> None:
        super().__init__(message, command=command, reply=reply, log_tail=log_tail)


class DaemonStartError(DaemonError):
    """The control daemon exited or could not be started."""


class DaemonTimeoutError(DaemonError, TimeoutError):
    """The control daemon did not answer or reach a state before its deadline."""


class NotMPSClientError(MPSError, RuntimeError):
    """Processes use the GPU without being clients of the session's MPS server.

    CUDA silently runs without MPS when a process cannot reach the daemon. Attributes:
    ``pids`` (the offending processes) and ``gpu`` (the UUID of the GPU they use).
    """

    pids: list[int]
    gpu: str

    def __init__(self, message: str, *, pids: Sequence[int] = (), gpu: str = "") -> None:
        super().__init__(message, pids=list(pids), gpu=gpu)


class JobTimeoutError(MPSError, TimeoutError):
    """The job's ``--timeout`` passed before its ranks could start (exit 124). Attribute: ``timeout``."""

    exit_code = ExitCode.TIMEOUT
    timeout: float

    def __init__(self, message: str, *, timeout: float = 0.0) -> None:
        super().__init__(message, timeout=timeout)


class TeardownError(MPSError, RuntimeError):
    """Stopping the session failed. Attribute: ``errors`` (the underlying exceptions)."""

    errors: list[BaseException]

    def __init__(self, message: str, *, errors: Sequence[BaseException] = ()) -> None:
        super().__init__(message, errors=list(errors))


class CommandNotExecutableError(MPSError, PermissionError):
    """The command to run as the ranks exists but cannot be executed. Attribute: ``command``."""

    exit_code = ExitCode.NOT_EXECUTABLE
    command: str

    def __init__(self, message: str, *, command: str = "") -> None:
        super().__init__(message, command=command)


class CommandNotFoundError(MPSError, FileNotFoundError):
    """The command to run as the ranks does not exist. Attribute: ``command``."""

    exit_code = ExitCode.NOT_FOUND

    command: str

    def __init__(self, message: str, *, command: str = "") -> None:
        super().__init__(message, command=command)


class SharedArrayError(MPSError, RuntimeError):
    """A shared array (:mod:`mpsrun.shared.api`) could not be had: outside a job, shapes that differ between ranks,
    a filling rank that failed, or a deadline. Attribute: ``name``."""

    name: str

    def __init__(self, message: str, *, name: str = "") -> None:
        super().__init__(message, name=name)


class WorkerDiedError(MPSError, RuntimeError):
    """A worker of an :class:`mpsrun.Executor` died while it ran a call (killed, or it ended its process): only that
    call's future fails, and a fresh worker takes the dead one's place. Attributes: ``worker`` (its number), ``gpu``
    (its GPU's index, None without one) and ``returncode`` (the process's: -N for signal N)."""

    worker: int
    gpu: int | None
    returncode: int | None

    def __init__(self, message: str, *, worker: int = -1, gpu: int | None = None,
                 returncode: int | None = None) -> None:
        super().__init__(message, worker=worker, gpu=gpu, returncode=returncode)


# -- mpsrun's own: raised and caught inside, never reaching a caller of the public API -------------------


class InterruptionError(MPSError):
    """mpsrun was stopped by a signal before its job ran (exit 128+N). Attribute: ``signal``."""

    signal: int

    def __init__(self, message: str = "", *, signal: int = 0) -> None:
        super().__init__(message or f"interrupted by {signal_name(signal)}", signal=signal)
        self.exit_code = exitcodes.exit_code(exitcodes.Outcome("signal", signal))


class RecordError(MPSError, ValueError):
    """A session.json that cannot be read or does not hold a session record."""


class LockHeldError(MPSError, TimeoutError):
    """Another process of the user held the lock on the session root past the wait. Attributes: ``path`` (the
    root), ``seconds`` (the wait)."""

    path: str
    seconds: float

    def __init__(self, message: str, *, path: str = "", seconds: float = 0.0) -> None:
        super().__init__(message, path=path, seconds=seconds)


class HandoffError(MPSError):
    """A shared region could not be had: its publisher failed, or the deadline passed."""


class JoinError(MPSError):
    """A per-node rank could not join its node's session. ``speaks``: whether this rank says why, so that the node
    says it once (what any keeper of the node would meet, by its local rank 0; what only one keeper met, by the
    rank that started it). ``exit_code``: the cause's."""

    speaks: bool

    def __init__(self, message: str, *, speaks: bool, exit_code: int = ExitCode.SETUP) -> None:
        super().__init__(message, speaks=speaks)
        self.exit_code = exit_code
