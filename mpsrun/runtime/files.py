"""Reading files that other processes write: a rank's CUDA and NCCL logs, an MPS daemon's log.

A rank can reach every one of them (it is told the paths), so a program may plant a FIFO, which would
block an ``open`` for ever, or a symlink to ``/dev/zero``, which never ends. These reads never follow a
symlink, never block on opening, take regular files only and stop at a size.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["LOG_READ_LIMIT", "read_log"]

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
