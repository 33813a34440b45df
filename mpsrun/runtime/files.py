"""Files other processes write or read: a rank's CUDA and NCCL logs, an MPS daemon's log, what ``mpsrun top`` reads.

A rank can reach every one of them (it is told the paths), so a program may plant a FIFO, which would
block an ``open`` for ever, or a symlink to ``/dev/zero``, which never ends. These reads never follow a
symlink, never block on opening, take regular files only and stop at a size; a write goes to a new file of
a random name, renamed over the target (a rename replaces a planted symlink, never follows it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path

__all__ = ["LOG_READ_LIMIT", "publish", "read_log"]

#: The most bytes one read returns: far more than any log mpsrun reads holds in a job.
LOG_READ_LIMIT = 1 << 26

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_log(path: str | os.PathLike[str], *, start: int | None = None, last: int = LOG_READ_LIMIT) -> bytes:
    """At most ``last`` bytes of a regular file: from offset ``start``, else its last ``last`` bytes.

    Raises ``OSError`` when the file is missing, is a symlink or is not a regular file."""
    fd = os.open(path, _FLAGS)
    with os.fdopen(fd, "rb") as log:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        log.seek(max(0, info.st_size - last) if start is None else start)
        return log.read(last)


def publish(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` whole, or not at all, for readers such as ``mpsrun top`` (which never see
    half of it). A directory that is going away only costs the file."""
    import tempfile  # (random, shutil and more): only once a job has a peak to publish

    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
