"""Files other processes write or read: session records, ``usage.json``, host files, a rank's CUDA and NCCL logs,
an MPS daemon's log.

A rank can reach every one of them (it is told the paths), so a program may plant a FIFO, which would
block an ``open`` for ever, or a symlink to ``/dev/zero``, which never ends. These reads never follow a
symlink, never block on opening, take regular files only and stop at a size; a write goes to a new file of
a random name, renamed over the target (a rename replaces a planted symlink or FIFO, never follows or opens it).
A directory is removed as ``rm -rf`` does, whatever a rank planted in it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import stat
import struct
import termios
import time
from pathlib import Path

__all__ = ["LOG_READ_LIMIT", "WRITE_PATIENCE", "publish", "read_file", "read_log", "remove_tree", "replace_file",
           "write_all", "write_into"]

#: The most bytes one read returns: far more than any log mpsrun reads holds in a job.
LOG_READ_LIMIT = 1 << 26

#: Seconds a write into a FIFO may wait for its reader to take more (a reader that stopped reading is an error).
WRITE_PATIENCE = 2.0

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_regular(path: str | os.PathLike[str], follow: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path`` and its status. A FIFO or device (and, unless ``follow``, a link)
    is refused before it is opened (opening some devices does something), and again after (it may have been swapped
    in between)."""
    if not stat.S_ISREG(os.stat(path, follow_symlinks=follow).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    fd = os.open(path, _FLAGS & ~os.O_NOFOLLOW if follow else _FLAGS)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    return fd, info


def read_log(path: str | os.PathLike[str], *, start: int | None = None, last: int = LOG_READ_LIMIT) -> bytes:
    """At most ``last`` bytes of a regular file: from offset ``start``, else its last ``last`` bytes.

    Raises ``OSError`` when the file is missing, is a symlink or is not a regular file."""
    fd, info = _open_regular(path)
    with os.fdopen(fd, "rb") as log:
        log.seek(max(0, info.st_size - last) if start is None else start)
        return log.read(last)


def read_file(path: str | os.PathLike[str], limit: int, follow: bool = False) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (through a symlink only if ``follow``: a file the user
    named).

    Raises ``OSError`` when the file is missing, is a symlink, is not a regular file or is larger."""
    fd, info = _open_regular(path, follow)
    with os.fdopen(fd, "rb") as stream:
        data = stream.read(limit + 1)  # the size may have grown since fstat
    if info.st_size > limit or len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
    return data


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a new file of a random name beside it (``mode`` less the
    umask), renamed over it. Raises ``OSError`` (no space left, the directory gone), leaving nothing behind."""
    while True:  # as tempfile.mkstemp makes its file, without importing it (random, shutil) on every job's path
        temporary = path.with_name(f".{path.name}.{os.urandom(6).hex()}")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
        break
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def publish(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` whole, or not at all, for readers such as ``mpsrun top`` (which never see
    half of it). A directory that is going away only costs the file."""
    with contextlib.suppress(OSError):
        replace_file(path, json.dumps(data).encode())


def write_into(path: str, data: bytes, patience: float = WRITE_PATIENCE) -> None:
    """Write ``data`` into the FIFO or device at ``path`` as it stands, never waiting for ever: a FIFO that no one
    has open, or whose reader takes nothing for ``patience`` seconds (a pipe holds 64 KiB), is an ``OSError``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise OSError(exc.errno, "a FIFO that no one reads", path) from None
        raise
    try:
        write_all(fd, data, path, patience)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes, path: str, patience: float = WRITE_PATIENCE) -> None:
    """Write all of ``data`` to the non-blocking descriptor ``fd`` (of ``path``), waiting while a pipe's reader takes
    something within each ``patience`` seconds (one that stopped reading is an ``OSError``, never a wait for ever)."""
    writable = select.poll()
    writable.register(fd, select.POLLOUT)
    view = memoryview(data)
    unread, since = _unread(fd), time.monotonic()
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            # A pipe says it has room only once a whole page of it is free: a reader that takes a line at a time is
            # seen taking by what is left unread.
            if writable.poll(_WRITE_POLL * 1000):
                continue
            now = _unread(fd)
            if now is not None and unread is not None and now < unread:
                since = time.monotonic()
            unread = now
            if time.monotonic() - since > patience:
                raise OSError(errno.ETIMEDOUT, f"a FIFO whose reader took nothing for {patience:g} s",
                              path) from None


#: How often a write into a full pipe looks whether its reader took anything.
_WRITE_POLL = 0.1


def _unread(fd: int) -> int | None:
    """The bytes a pipe holds unread (None where ``fd`` is no pipe, or the kernel does not say)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return None


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove the directory ``path`` and all below it, a link only unlinked, never followed, a mount point never
    entered (``path`` itself neither); nothing there is no error.

    A rank can plant a tree thousands of levels deep, past Python's recursion (``shutil.rmtree`` recurses per level)
    and the descriptors one process may hold: each directory's subdirectories are moved up into the top one before
    it is emptied and removed, so a tree of any depth takes two descriptors. Raises ``OSError`` for what cannot go
    (a mount point), once all else has gone."""
    where = os.path.abspath(os.fspath(path))
    try:
        parent = os.open(os.path.dirname(where), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            try:
                os.unlink(os.path.basename(where), dir_fd=parent)  # a link, or a file where the directory was
                return
            except IsADirectoryError:
                pass
            doomed = _renamed(os.path.basename(where), parent)
            top = _opened(doomed, parent)
            try:
                _make_ours(top)
                _empty(top)
            except OSError as exc:  # said with where it is now (a mount point's name alone would not find it)
                raise OSError(exc.errno, f"{exc.strerror} in {os.path.join(os.path.dirname(where), doomed)}",
                              exc.filename) from None
            finally:
                os.close(top)
            os.rmdir(doomed, dir_fd=parent)
    finally:
        os.close(parent)


def _empty(top: int) -> None:
    """Remove everything in ``top``, pass after pass (each moves subdirectories up); what cannot go (a mount point)
    does not stop the rest. Raises the first failure once a pass removed nothing."""
    while names := os.listdir(top):
        failures = []
        for name in names:
            try:
                _remove_entry(top, name)
            except OSError as exc:
                failures.append(exc)
        if len(failures) == len(names):
            raise failures[0]


def _renamed(name: str, parent: int, into: int | None = None) -> str:
    """The directory ``name`` in ``parent`` under a fresh name there (or in ``into``), before it is entered: a mount
    point refuses that, and is never entered (a bind mount of another directory would lose that directory's files)."""
    here = f".{os.urandom(8).hex()}"
    try:
        os.rename(name, here, src_dir_fd=parent, dst_dir_fd=parent if into is None else into)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise OSError(exc.errno, "a mount point, not entered", name) from None
        raise
    return here


def _opened(name: str, parent: int) -> int:
    """The directory ``name`` in ``parent``, opened (never a link); one a rank made unreadable is made ours first."""
    try:
        return os.open(name, _DIRECTORY, dir_fd=parent)
    except PermissionError:  # (its own directory: the rank could undo it too)
        _make_ours_by_name(name, parent)
        return os.open(name, _DIRECTORY, dir_fd=parent)


def _remove_entry(top: int, name: str) -> None:
    """Remove ``name`` in ``top``: a file or link at once; a directory (renamed first: see :func:`_renamed`) once
    its subdirectories are moved up into ``top`` (which removes them in their turn) and its files unlinked."""
    with contextlib.suppress(FileNotFoundError):
        try:
            os.unlink(name, dir_fd=top)
            return
        except IsADirectoryError:
            pass
        here = _renamed(name, top)
        fd = _opened(here, top)
        stuck = None
        try:
            _make_ours(fd)
            for entry in os.listdir(fd):
                try:
                    _unlink_or_move_up(entry, fd, top)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # (a mount point): the others go all the same
                    stuck = stuck or exc
        finally:
            os.close(fd)
        if stuck is not None:
            raise stuck
        os.rmdir(here, dir_fd=top)


def _unlink_or_move_up(name: str, parent: int, top: int) -> None:
    try:
        os.unlink(name, dir_fd=parent)
    except IsADirectoryError:
        _move_up(name, parent, top)


def _move_up(name: str, parent: int, top: int) -> None:
    """Move the directory ``name`` in ``parent`` into ``top``, under a fresh name. Moving a directory rewrites its
    ``..``: one a rank made read-only (0500, 000) is made writable first."""
    try:
        _renamed(name, parent, top)
    except PermissionError:
        _make_ours_by_name(name, parent)
        _renamed(name, parent, top)


def _make_ours_by_name(name: str, parent: int) -> None:
    """:func:`_make_ours` for the directory ``name`` in ``parent``, which we may not even read (mode 000): through a
    path descriptor (O_PATH, never a link), as fchmod cannot take one."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def _make_ours(directory: int) -> None:
    """A directory a rank made read-only (as Go's module cache and ``cp -a`` of a read-only tree make them) becomes
    writable, so its entries can go; one not the user's is left as it is."""
    with contextlib.suppress(OSError):
        os.fchmod(directory, 0o700)
