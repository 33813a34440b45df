"""Private per-session directories: where they go, how they are checked, made, locked and removed.

Layout (one object holds every path, as submitit does)::

    <base>/mpsrun-<uid>/            base: $MPSRUN_TMPDIR, else $XDG_RUNTIME_DIR, else /tmp
        <session id>/               mode 0700: a random name, or j<hash> for a node session
            session.json            the typed record (mpsrun.session.record)
            control                 the controller's socket (ranks report here)
            output.lock             taken around long tagged output lines
            gpu<N>/pipe/            CUDA_MPS_PIPE_DIRECTORY of GPU N's daemon
            gpu<N>/log/             CUDA_MPS_LOG_DIRECTORY (control.log lives here)

Every file a job makes lives in its session directory. The pipe directory holds UNIX
sockets, whose paths Linux limits to 107 bytes, so paths are kept short and checked first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from mpsrun.errors import ConfigError, LockHeldError, MPSError, UnsafeDirectoryError
from mpsrun.runtime.constants import LOCK_TIMEOUT, TMPDIR_VARIABLE
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.files import remove_tree

__all__ = [
    "DIRECTORY_FLAGS",
    "RECORD_FILE",
    "SOCKET_PATH_MAX",
    "SessionDirs",
    "base_directory",
    "check_private_dir",
    "make_user_root",
    "new_session_name",
    "open_user_root",
    "session_base",
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
#: A session's record, in its directory.
RECORD_FILE = "session.json"


def base_directory(environ: Mapping[str, str] | None = None) -> Path:
    """The directory under which this user's session root is made, as an absolute path: the daemons run in
    directories of their own, where a relative pipe directory would name another place."""
    env = os.environ if environ is None else environ
    for name in (TMPDIR_VARIABLE, "XDG_RUNTIME_DIR"):
        value = env.get(name)
        if value:
            return Path(value).absolute()
    return Path("/tmp")


def session_base(tmpdir: object = None) -> Path:
    """Where an ``mps_session(tmpdir=...)`` makes its directories, checked (socket path length)."""
    if tmpdir is not None and (not isinstance(tmpdir, (str, os.PathLike)) or not os.fspath(tmpdir)):
        raise ConfigError(f"tmpdir must name a directory, not {tmpdir!r}", setting="tmpdir", value=tmpdir)
    base = Path(tmpdir).absolute() if tmpdir is not None else base_directory()
    validate_base(base)
    return base


def user_root(base: Path) -> Path:
    """This user's root for sessions under ``base``."""
    return base / f"mpsrun-{os.getuid()}"


def longest_socket_path(root: Path) -> int:
    """Bytes in the longest socket path a session under ``root`` can create."""
    sample = root / ("s" * _SESSION_ID_LEN) / f"gpu{'9' * _MAX_GPU_DIGITS}" / "pipe" / _LONGEST_SOCKET
    return len(os.fsencode(sample))


DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(path: Path, reason: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(f"refusing to use {path}: it {reason}; remove it or set MPSRUN_TMPDIR to a private "
                                "directory", path=str(path), reason=reason)


def _check_private(info: os.stat_result, path: Path) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, "is a symbolic link")
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, "is not a directory")
    if info.st_uid != os.getuid():
        raise _refuse(path, f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise _refuse(path, f"has mode {stat.S_IMODE(info.st_mode):04o}; it must be private (0700)")


def check_private_dir(path: Path) -> None:
    """Refuse a directory that is a symlink, not ours, or writable by others (checked with lstat)."""
    _check_private(os.lstat(path), path)


def _check_base(info: os.stat_result, base: Path) -> None:
    """Refuse a base in which another user could move this user's entries."""
    if info.st_uid not in (0, os.getuid()):
        raise UnsafeDirectoryError(
            f"refusing to use {base}: it is owned by uid {info.st_uid}, who could move your sessions; "
            "set MPSRUN_TMPDIR to a directory of yours", path=str(base), reason="owned by another user")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectoryError(
            f"refusing to use {base}: others may write to it and it has no sticky bit (mode "
            f"{stat.S_IMODE(info.st_mode):04o}), so they could move your sessions; set MPSRUN_TMPDIR",
            path=str(base), reason="writable by others without the sticky bit")


def _checked(fd: int, check: Callable[[], None]) -> int:
    """``fd`` once ``check`` passes; closed if it does not."""
    try:
        check()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_writable(fd: int, base: Path) -> None:
    """One where no directory can be made (permissions, /proc/self) is the machine's refusal, exit 3."""
    if not os.access(f"/proc/self/fd/{fd}", os.W_OK | os.X_OK):
        raise MPSError(f"cannot make a session directory under {base}: not writable; set MPSRUN_TMPDIR elsewhere")


_MAX_LINKS = 40  # as the kernel counts them: more is a loop


def _check_links(base: Path) -> None:
    """Every symbolic link on the way to ``base`` is ours or root's: another user's could be pointed elsewhere
    between our checks and our ranks' use of the path (checking the target alone would miss it)."""
    done, todo, links = Path("/"), list(Path(os.path.abspath(base)).parts[1:]), 0
    while todo:
        here = done / todo.pop(0)
        try:
            info = os.lstat(here)
        except OSError:
            return  # missing: _open_base says so
        if not stat.S_ISLNK(info.st_mode):
            done = here
            continue
        links += 1
        if info.st_uid not in (0, os.getuid()) or links > _MAX_LINKS:
            raise UnsafeDirectoryError(f"refusing to use {base}: the way to it goes through {here}, a symbolic link "
                                       f"of uid {info.st_uid}, who could point it elsewhere; set MPSRUN_TMPDIR to a "
                                       "path of yours", path=str(base), reason="another user's symbolic link")
        target = Path(os.readlink(here))
        todo = [*target.parts[1:], *todo] if target.is_absolute() else [*target.parts, *todo]
        done = Path("/") if target.is_absolute() else done


def _open_base(base: Path) -> int:
    _check_links(base)
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise ConfigError(f"session directory base {base} does not exist or is not a directory; set MPSRUN_TMPDIR",
                          setting="tmpdir", value=str(base)) from None

    def check() -> None:
        _check_base(os.fstat(fd), base)
        _check_writable(fd, base)

    return _checked(fd, check)


def _open_private(name: str, parent_fd: int, path: Path, create: bool) -> int:
    """Open (making it first if asked) a private directory in ``parent_fd`` without following a link, checked."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)  # an existing one is checked below
    try:
        fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent_fd)
    except OSError:
        _check_private(os.lstat(name, dir_fd=parent_fd), path)  # says why (a link, not a directory)
        raise
    return _checked(fd, lambda: _check_private(os.fstat(fd), path))


def _make_gpu_dirs(session_fd: int, gpu_indices: list[int]) -> None:
    """Each GPU's ``gpuN/pipe`` and ``gpuN/log`` in the session's directory; ``session_fd`` is closed after."""
    try:
        for index in gpu_indices:
            os.mkdir(f"gpu{index}", 0o700, dir_fd=session_fd)
            gpu_fd = os.open(f"gpu{index}", DIRECTORY_FLAGS, dir_fd=session_fd)
            try:
                for part in ("pipe", "log"):
                    os.mkdir(part, 0o700, dir_fd=gpu_fd)
            finally:
                os.close(gpu_fd)
    finally:
        os.close(session_fd)


def open_user_root(base: Path) -> int:
    """This user's private root under ``base``: made 0700 if missing, refused if unsafe; an open descriptor. All is
    checked on descriptors, in a base no other user may move entries in: what was checked is what is used."""
    base_fd = _open_base(base)
    try:
        return _open_private(user_root(base).name, base_fd, user_root(base), create=True)
    finally:
        os.close(base_fd)


def make_user_root(base: Path) -> Path:
    """This user's private root under ``base``, made 0700 if missing, refused if unsafe (MPSError, also for what
    the machine refuses: a base under /proc, no space left)."""
    try:
        os.close(open_user_root(base))
    except OSError as exc:
        if isinstance(exc, MPSError):
            raise
        raise MPSError(f"cannot make a session directory under {base}: {exc.strerror or exc}") from None
    return user_root(base)


def _random_name() -> str:
    return "s" + os.urandom(4).hex()  # as secrets.token_hex(4), without importing hashlib


def new_session_name(base: Path) -> str:
    """A random session name not in use under ``base``, for :meth:`SessionDirs.create` to make later."""
    while (user_root(base) / (name := _random_name())).exists():
        pass
    return name


def _new_directory(root_fd: int) -> str:
    """Make a directory with a fresh random name in ``root_fd`` (atomically) and return the name."""
    while True:
        name = _random_name()
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
        except FileExistsError:
            continue
        return name


def validate_base(base: Path) -> None:
    """Raise :class:`ConfigError` if sessions under ``base`` would overflow a socket path."""
    length = longest_socket_path(user_root(base))
    if length > SOCKET_PATH_MAX:
        raise ConfigError(f"session directory base {base} is too long: MPS sockets under it would need {length} bytes "
                          f"(limit {SOCKET_PATH_MAX}); set MPSRUN_TMPDIR to a shorter directory, e.g. /tmp",
                          setting="tmpdir", value=str(base))


@contextlib.contextmanager
def user_root_lock(base: Path, timeout: float = LOCK_TIMEOUT) -> Iterator[Path]:
    """Hold this user's lock on the session root under ``base`` (node sessions start and end under it): flock on
    the root directory itself, which outlives every session, so no lock file is ever left behind."""
    fd = open_user_root(base)
    try:
        if not poll_until(lambda: _try_lock(fd), Deadline(timeout)):
            raise LockHeldError(f"another mpsrun of yours held the lock on {user_root(base)} for more than "
                                f"{timeout:.3g} s", path=str(user_root(base)), seconds=timeout)
        yield user_root(base)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _try_lock(fd: int) -> bool | None:
    """The lock on ``fd``, or None while another process holds it (filelock's import cost more than its flock)."""
    with contextlib.suppress(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    return None


class SessionDirs(NamedTuple):
    """Every path of one session. Create with :meth:`create`; remove with :meth:`remove`."""

    root: Path

    @classmethod
    def create(cls, base: Path, gpu_indices: list[int], name: str | None = None,
               reserved: bool = False) -> SessionDirs:
        """Make a private session directory with a pipe and log directory per GPU.

        Without ``name`` the directory gets a fresh random name (made atomically); a node
        session passes the name every local rank of a job computes, its directory ``reserved``
        by its starting rank (:func:`reserve_session_name`). Made through directory
        descriptors from the checked user root down: no path is resolved twice.
        """
        validate_base(base)
        root_fd = open_user_root(base)
        try:
            if name is None:
                name = _new_directory(root_fd)
            elif not reserved:
                os.mkdir(name, 0o700, dir_fd=root_fd)
            session_fd = _open_private(name, root_fd, user_root(base) / name, create=False)
        finally:
            os.close(root_fd)
        _make_gpu_dirs(session_fd, gpu_indices)
        return cls(root=user_root(base) / name)

    def add_gpus(self, gpu_indices: list[int]) -> None:
        """Make the pipe and log directories of more GPUs (a session's directory is made before its GPUs are read)."""
        parent_fd = os.open(self.root.parent, DIRECTORY_FLAGS)
        try:
            session_fd = _open_private(self.root.name, parent_fd, self.root, create=False)
        finally:
            os.close(parent_fd)
        _make_gpu_dirs(session_fd, gpu_indices)

    @property
    def session_id(self) -> str:
        return self.root.name

    @property
    def record_file(self) -> Path:
        return self.root / RECORD_FILE

    @property
    def usage_file(self) -> Path:  # for mpsrun top: each rank's host, pid and peak device memory so far
        return self.root / "usage.json"

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

    def remove(self) -> None:
        """Delete the session directory and everything in it (sockets included; a link is only unlinked). It is
        renamed away first, so a node session of its name made meanwhile (by a late rank) is never touched."""
        if self.root.is_symlink():
            self.root.unlink()
            return
        doomed = self.root.with_name(f"{self.root.name}-gone{os.urandom(3).hex()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.root, doomed)
            remove_tree(doomed)  # raises with the reason
