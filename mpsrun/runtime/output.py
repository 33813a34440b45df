"""A rank's output passed on in whole lines (``[rank N] ``-prefixed under ``--tag-output``), and mpsrun's own lines.

Every rank's stdout and stderr reach its supervisor through a pipe (or a terminal of its own), and the supervisor
writes them on in whole lines, however the rank buffers: a print of unbuffered Python writes its text and its newline
apart, and a block-buffered rank cuts its lines where its buffer fills. Ranks that share a sink (the local launcher's
ranks write to mpsrun's stdout) take an advisory lock for each write, so no write, however long, is broken into by
another's. A partial line is written when the rank's stream ends, once it grows past ``limit`` bytes (1 MiB: a longer
line is written in pieces), so memory stays bounded whatever the rank prints, or when it is flushed on purpose (a
prompt on a terminal).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import stat
import struct
import sys
import termios
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

from mpsrun.runtime.constants import OUTPUT_LOCK_PATIENCE
from mpsrun.runtime.deadline import Deadline

__all__ = ["LINE_MOST", "LineWriter", "clipped", "one_line", "printable", "say", "unread", "unread_output"]

PIPE_BUF = select.PIPE_BUF


def printable(text: str) -> str:
    """``text`` as it is, or quoted with its escapes where it holds a newline or another control character (a file
    name may): a message of ours stays one line."""
    return text if text.isprintable() else repr(text)


def clipped(text: str, most: int) -> str:
    """``text`` cut to ``most`` characters, its end marked (a value of thousands would stretch a line or a row)."""
    return text if len(text) <= most else text[: most - 3] + "..."


def escaped(text: str) -> str:
    """``text`` with each control character written as its escape (``\\x1b``, ``\\n``): what a rank, a record or the
    machine put in a line of ours reaches the terminal as text, and the line stays one line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: The most characters a line of ours holds: what it quotes (a daemon's log, a file's line, a value given) is cut.
LINE_MOST = 2000


def one_line(text: str) -> str:
    """``text`` as a line of ours shows it: escaped, and cut to LINE_MOST."""
    return clipped(escaped(text), LINE_MOST)


def say(line: str) -> None:
    """Write a line of ours to stderr as :func:`one_line` shows it, in one write (print writes the newline apart:
    with unbuffered output the lines of several processes then run into each other); nothing if stderr is gone."""
    if sys.stderr is None:  # started with stderr closed
        return
    try:
        sys.stderr.write(one_line(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def unread(fd: int) -> int:
    """How many bytes the pipe (or terminal) ``fd`` holds that its reader has not read yet; 0 where that cannot be
    told."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, bytes(4)))[0])
    except OSError:
        return 0


def unread_output() -> int:
    """How many bytes our stdout and stderr pipes hold that their readers have not read yet (0 for a terminal or a
    file): while there are some, whoever writes there may be waiting for a slow reader."""
    total = 0
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                total += unread(fd)
    return total


class LineWriter:
    """One output stream of a rank, written to ``sink`` in whole lines.

    ``prefix``: put before every line (``--tag-output``); a tagged partial line is always written as a line of its
    own. Untagged, the bytes are the rank's: a line past ``limit`` is written in pieces as they are, and a partial
    last line gets a newline only where ``end_partial`` says so (a job of several ranks: the next line, perhaps
    another rank's, starts on its own), so a one-rank job's output stays byte for byte its own. ``lock_path``: the
    advisory lock of the ranks that share ``sink``; ``aside``: entered around each write (a farm's progress line
    steps aside for it).
    """

    def __init__(self, sink: int, prefix: bytes = b"", end_partial: bool = True, lock_path: str | None = None,
                 limit: int = 1 << 20, aside: AbstractContextManager[object] | None = None) -> None:
        self.sink, self.aside = sink, aside
        self.prefix = prefix
        self.end_partial = end_partial
        self.limit = limit
        self.broken = False  # our own output is gone (e.g. `mpsrun ... | head -1`), or cannot take more
        self.failure: str | None = None  # why, where that is not its reader's going (a full disk, a hung-up terminal)
        self.partial_since: float | None = None  # when the partial line now held began (monotonic)
        self.lock_given_up = False  # the lock was held by no writer of the job (see _take_lock)
        self._partial = b""
        self._lock = _open_lock(lock_path)

    def feed(self, data: bytes) -> bool:
        """Take a chunk of the rank's output; False once our output is broken."""
        data = self._partial + data if self._partial else data
        end = data.rfind(b"\n") + 1
        if end:
            self._write(self._lines(data[:end]))
        self._partial = data[end:]
        while len(self._partial) > self.limit and not self.broken:
            self._write(self._piece(self._partial[: self.limit], bool(self.prefix)))
            self._partial = self._partial[self.limit :]
        self.partial_since = None if not self._partial else self.partial_since or time.monotonic()
        return not self.broken

    def flush_partial(self) -> None:
        """Write the partial line held now as it is, without ending it (an untagged prompt that waits for its answer:
        the rest of its line comes unprefixed)."""
        if self._partial:
            self._write(self._partial)
            self._partial = b""
        self.partial_since = None

    def finish(self) -> None:
        """The stream ended: write what is left of an unterminated line."""
        if self._partial:
            self._write(self._piece(self._partial, bool(self.prefix) or self.end_partial))
            self._partial = b""
        self.partial_since = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _lines(self, whole: bytes) -> bytes:
        """Whole lines (``whole`` ends with a newline), each prefixed."""
        if not self.prefix:
            return whole
        return self.prefix + whole[:-1].replace(b"\n", b"\n" + self.prefix) + b"\n"

    def _piece(self, partial: bytes, ended: bool) -> bytes:
        """A partial line, written as the stream ends or in pieces past ``limit``: ``ended`` with a newline."""
        return self.prefix + partial + b"\n" if ended else partial

    def _write(self, records: bytes) -> None:
        """Write ``records`` in pieces of whole lines of at most PIPE_BUF bytes (a longer line alone): the kernel
        keeps such a write to a pipe in one piece, so a reader that takes what the pipe holds (MPICH's Hydra reads
        64 KiB, a pipe's size) never gets part of a line."""
        if self.broken:
            return
        try:
            if self._lock is not None:
                self._take_lock()
            with self.aside or contextlib.nullcontext():
                for piece in _pieces(records):
                    while piece:
                        try:
                            piece = piece[os.write(self.sink, piece) :]
                        except BlockingIOError:  # an output left non-blocking (a pipe's flags are shared): wait
                            select.select([], [self.sink], [])  # as a blocking write does
        except OSError as exc:  # what follows is dropped: the rank gets EPIPE, as when writing there itself
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                self.failure = exc.strerror or str(exc)
            self.broken = True
        finally:
            if self._lock is not None:
                fcntl.flock(self._lock, fcntl.LOCK_UN)

    def _take_lock(self) -> None:
        """Take the ranks' output lock. It is held only across a write to the output, so a holder that keeps it for
        OUTPUT_LOCK_PATIENCE while the output has room writes nothing (a process a rank left running, outside its
        group, holds it): then the lock is given up, and this writer's lines go without it. Else a rank could hold
        every supervisor of its job, and its output, past --timeout."""
        lock = self._lock
        assert lock is not None
        patience, pause = Deadline(OUTPUT_LOCK_PATIENCE), 0.0001
        while True:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            if not select.select([], [self.sink], [], 0)[1]:
                patience = Deadline(OUTPUT_LOCK_PATIENCE)  # the output is full: its holder waits for room, as we would
            elif patience.expired():
                os.close(lock)
                self._lock, self.lock_given_up = None, True
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.01)


def _pieces(records: bytes) -> Iterator[memoryview]:
    """``records`` cut after a newline into pieces of at most PIPE_BUF bytes where its lines allow."""
    view, start = memoryview(records), 0
    while len(records) - start > PIPE_BUF:
        cut = records.rfind(b"\n", start, start + PIPE_BUF) + 1
        if cut <= start:  # a line longer than PIPE_BUF: alone
            cut = records.find(b"\n", start + PIPE_BUF) + 1 or len(records)
        yield view[start:cut]
        start = cut
    if start < len(records):
        yield view[start:]


def _open_lock(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)  # a rank's FIFO: no wait
    except OSError:
        return None
