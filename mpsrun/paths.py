"""Private per-session directories: where they go, how they are checked, made, locked and removed.

Layout (one object holds every path, as submitit does)::

    <base>/mpsrun-<uid>/            base: $MPSRUN_TMPDIR, else $XDG_RUNTIME_DIR, else /tmp
        <session id>/               mode 0700: a random name, or j<hash> for a node session
            session.json            the typed record (mpsrun.records)
            control                 the controller's socket (ranks report here)
            output.lock             taken around long tagged output lines
            gpu<N>/pipe/            CUDA_MPS_PIPE_DIRECTORY of GPU N's daemon
            gpu<N>/log/             CUDA_MPS_LOG_DIRECTORY (control.log lives here)

Every file a job makes lives in its session directory. The pipe directory holds UNIX
sockets, whose paths Linux limits to 107 bytes, so paths are kept short and checked first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs
import filelock

from mpsrun.deadline import Deadline, poll_until
from mpsrun.errors import ConfigError, MPSError, UnsafeDirectoryError

__all__ = [
    "SOCKET_PATH_MAX",
    "SessionDirs",
    "base_directory",
    "check_private_dir",
    "make_user_root",
    "user_root",
    "user_root_lock",
    "validate_base",
]

#: Longest UNIX socket path (``sun_path`` is 108 bytes including the terminating NUL).
SOCKET_PATH_MAX = 107
#: The longest socket name the MPS daemon creates in its pipe directory.
_LONGEST_SOCKET = "control_privileged"
#: Length of a session id made by :func:`tempfile.mkdtemp` with our prefix.
_SESSION_ID_LEN = len("s") + 8
_MAX_GPU_DIGITS = 3


def base_directory(environ: Mapping[str, str] | None = None) -> Path:
    """The directory under which this user's session root is made."""
    env = os.environ if environ is None else environ
    for name in ("MPSRUN_TMPDIR", "XDG_RUNTIME_DIR"):
        value = env.get(name)
        if value:
            return Path(value)
    return Path("/tmp")


def user_root(base: Path) -> Path:
    """This user's root for sessions under ``base``."""
    return base / f"mpsrun-{os.getuid()}"


def longest_socket_path(root: Path) -> int:
    """Bytes in the longest socket path a session under ``root`` can create."""
    sample = root / ("s" * _SESSION_ID_LEN) / f"gpu{'9' * _MAX_GPU_DIGITS}" / "pipe" / _LONGEST_SOCKET
    return len(os.fsencode(sample))


def check_private_dir(path: Path) -> None:
    """Refuse a directory that is a symlink, not ours, or writable by others (checked with lstat)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        reason = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        reason = "is not a directory"
    elif info.st_uid != os.getuid():
        reason = f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    elif info.st_mode & 0o077:
        reason = f"has mode {stat.S_IMODE(info.st_mode):04o}; it must be private (0700)"
    else:
        return
    raise UnsafeDirectoryError(
        f"refusing to use {path}: it {reason}; remove it or set MPSRUN_TMPDIR to a private directory",
        path=str(path),
        reason=reason,
    )


def make_user_root(base: Path) -> Path:
    """This user's private root under ``base``, made 0700 if missing, refused if unsafe."""
    if not base.is_dir():
        raise ConfigError(
            f"session directory base {base} does not exist or is not a directory; set MPSRUN_TMPDIR",
            setting="tmpdir",
            value=str(base),
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot create session directories in {base}: not writable; set MPSRUN_TMPDIR to a writable directory",
            setting="tmpdir",
            value=str(base),
        )
    root = user_root(base)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)  # an existing one is checked below
    check_private_dir(root)
    return root


def validate_base(base: Path) -> None:
    """Raise :class:`ConfigError` if sessions under ``base`` would overflow a socket path."""
    length = longest_socket_path(user_root(base))
    if length > SOCKET_PATH_MAX:
        raise ConfigError(
            f"session directory base {base} is too long: MPS sockets under it would need {length} bytes "
            f"(limit {SOCKET_PATH_MAX}); set MPSRUN_TMPDIR to a shorter directory, e.g. /tmp",
            setting="tmpdir",
            value=str(base),
        )


@contextlib.contextmanager
def user_root_lock(base: Path, timeout: float = 60.0) -> Iterator[Path]:
    """Hold this user's lock on the session root under ``base`` (node sessions start and end under it).

    The lock is on the root directory itself, which outlives every session, so no lock
    file is ever left behind.
    """
    root = make_user_root(base)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if not poll_until(lambda: filelock.lock_descriptor(fd, blocking=False) or None, Deadline(timeout)):
            raise MPSError(f"another mpsrun of yours held the lock on {root} for more than {timeout:g} s")
        yield root
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@attrs.define
class SessionDirs:
    """Every path of one session. Create with :meth:`create`; remove with :meth:`remove`."""

    root: Path

    @classmethod
    def create(cls, base: Path, gpu_indices: list[int], name: str | None = None) -> SessionDirs:
        """Make a private session directory with a pipe and log directory per GPU.

        Without ``name`` the directory gets a fresh random name (made atomically); a node
        session passes the name every local rank of a job computes.
        """
        validate_base(base)
        user = make_user_root(base)
        if name is None:
            root = Path(tempfile.mkdtemp(prefix="s", dir=user))  # mode 0700, unique, atomic
        else:
            root = user / name
            root.mkdir(mode=0o700)
        dirs = cls(root=root)
        for index in gpu_indices:
            for path in (dirs.pipe_dir(index), dirs.log_dir(index)):
                path.mkdir(mode=0o700, parents=True)
        return dirs

    @property
    def session_id(self) -> str:
        return self.root.name

    @property
    def record_file(self) -> Path:
        return self.root / "session.json"

    @property
    def control_socket(self) -> Path:
        return self.root / "control"

    @property
    def output_lock(self) -> Path:
        return self.root / "output.lock"

    def gpu_dir(self, index: int) -> Path:
        return self.root / f"gpu{index}"

    def pipe_dir(self, index: int) -> Path:
        return self.gpu_dir(index) / "pipe"

    def log_dir(self, index: int) -> Path:
        return self.gpu_dir(index) / "log"

    def control_log(self, index: int) -> Path:
        return self.log_dir(index) / "control.log"

    def remove(self) -> None:
        """Delete the session directory and everything in it (sockets included)."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():
            shutil.rmtree(self.root)  # a second try raises, with the reason
