"""Private per-session directories: where they go, how they are checked, made and removed.

Layout (one object holds every path, as submitit does)::

    <base>/mpsrun-<uid>/            base: $MPSRUN_TMPDIR, else $XDG_RUNTIME_DIR, else /tmp
        <session id>/               mode 0700, random name, made atomically
            session.json            who owns the session (pid, start time)
            gpu<N>/pipe/            CUDA_MPS_PIPE_DIRECTORY of GPU N's daemon
            gpu<N>/log/             CUDA_MPS_LOG_DIRECTORY (control.log lives here)

The pipe directory holds UNIX sockets, whose paths Linux limits to 107 bytes, so
paths are kept short and checked before anything starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs

from mpsrun.errors import ConfigError, UnsafeDirectoryError

__all__ = ["SOCKET_PATH_MAX", "SessionDirs", "base_directory", "check_private_dir", "user_root"]

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


@attrs.define
class SessionDirs:
    """Every path of one session. Create with :meth:`create`; remove with :meth:`remove`."""

    root: Path

    @classmethod
    def create(cls, base: Path, gpu_indices: list[int], name: str | None = None) -> SessionDirs:
        """Make a private session directory with a pipe and log directory per GPU.

        Without ``name`` the directory gets a fresh random name (made atomically); per-node
        mode passes the name every local rank of a job computes.
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
    def info_file(self) -> Path:
        return self.root / "session.json"

    def gpu_dir(self, index: int) -> Path:
        return self.root / f"gpu{index}"

    def pipe_dir(self, index: int) -> Path:
        return self.gpu_dir(index) / "pipe"

    def log_dir(self, index: int) -> Path:
        return self.gpu_dir(index) / "log"

    def control_log(self, index: int) -> Path:
        return self.log_dir(index) / "control.log"

    def write_info(self, info: Mapping[str, object]) -> None:
        tmp = self.info_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1, sort_keys=True))
        tmp.replace(self.info_file)

    def remove(self) -> None:
        """Delete the session directory and everything in it (sockets included)."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():
            shutil.rmtree(self.root)  # a second try raises, with the reason
