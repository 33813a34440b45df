"""``--tag-output``: a rank's output copied line by line, each line prefixed ``[rank N] ``.

Lines are written whole, with one write
each: the kernel keeps a pipe write of up to ``PIPE_BUF`` bytes (and any terminal or file
write) in one piece, and longer lines take an advisory lock shared by the job's shims. A
partial line is written when the rank's stream ends (with a newline added), or once it
grows past ``limit`` bytes (1 MiB: a longer line is written in tagged pieces), so memory
stays bounded whatever the rank prints.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import sys

__all__ = ["LineTagger", "printable", "say"]

PIPE_BUF = select.PIPE_BUF


def printable(text: str) -> str:
    """``text`` as it is, or quoted with its escapes where it holds a newline or another control character (a file
    name may): a message of ours stays one line."""
    return text if text.isprintable() else repr(text)


def say(line: str) -> None:
    """Write a line of ours to stderr in one write (print writes the newline apart: with unbuffered output the
    lines of several processes then run into each other); nothing if stderr is gone."""
    if sys.stderr is None:  # started with stderr closed
        return
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class LineTagger:
    def __init__(self, rank: int, sink: int, lock_path: str | None = None, limit: int = 1 << 20) -> None:
        self.prefix = f"[rank {rank}] ".encode()
        self.sink = sink
        self.limit = limit
        self.broken = False  # our own output is gone (e.g. `mpsrun ... | head -1`)
        self._partial = b""
        self._lock = _open_lock(lock_path)

    def feed(self, data: bytes) -> bool:
        """Take a chunk of the rank's output; False once our output is broken."""
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._write(line)
        while len(self._partial) > self.limit and not self.broken:
            self._write(self._partial[: self.limit])
            self._partial = self._partial[self.limit :]
        return not self.broken

    def finish(self) -> None:
        """The stream ended: write what is left of an unterminated line."""
        if self._partial:
            self._write(self._partial)
            self._partial = b""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _write(self, line: bytes) -> None:
        if self.broken:
            return
        record = self.prefix + line + b"\n"
        locked = self._lock is not None and len(record) > PIPE_BUF
        try:
            if locked:
                fcntl.flock(self._lock, fcntl.LOCK_EX)  # type: ignore[arg-type]
            view = memoryview(record)
            while view:
                view = view[os.write(self.sink, view) :]
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self.broken = True
        finally:
            if locked:
                fcntl.flock(self._lock, fcntl.LOCK_UN)  # type: ignore[arg-type]


def _open_lock(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)  # a rank's FIFO: no wait
    except OSError:
        return None
