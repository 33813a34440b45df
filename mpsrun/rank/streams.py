"""A rank's stdout and stderr, read by its supervisor and passed on in whole lines (tagged under ``--tag-output``).

Each stream reaches the supervisor through a pipe, or through a terminal of its own where the supervisor's own
stream is a terminal: the rank then buffers and colours its output as on a terminal (as it did when it wrote to
ours, and as Open MPI's ranks do). How the lines are written: :class:`mpsrun.runtime.output.LineWriter`.

Standard library only (the supervisor starts with ``python -S``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import termios
from contextlib import AbstractContextManager

from mpsrun.runtime.constants import OUTPUT_LOCK_PATIENCE, PARTIAL_LINE_WAIT
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import LineWriter, say, unread
from mpsrun.runtime.processes import close_all

__all__ = ["RankOutput", "output_files"]

SINKS = (1, 2)  # the rank's stdout and stderr go to ours


class RankOutput:
    """The rank's two streams: :meth:`open` makes their ends, :meth:`forward` passes them on from the rank's start,
    :meth:`drain` closes them after its end. ``name``: whose they are (``rank 3``, or a farm's ``task 17``);
    ``several``: the job has more ranks than this one (a partial last line
    is then ended, so the next rank's line starts on its own); ``lock``: the lock of the ranks that share our
    output (the local launcher's); ``aside``: entered around each write (a farm's progress line)."""

    def __init__(self, loop: EventLoop, name: str, tag: bool, several: bool, lock: str | None,
                 aside: AbstractContextManager[object] | None = None) -> None:
        self.loop, self.aside = loop, aside
        self.prefix = f"[{name}] ".encode() if tag else b""
        self.name, self.several, self.lock = name, several, lock
        self.ends: list[tuple[int, int]] = []  # (read end, write end) per sink, until forward()
        self.streams: dict[int, LineWriter] = {}  # by read end, until each is closed
        self.prompts: dict[int, float | None] = {}  # streams to a terminal: when their held partial line began
        self.lock_said = False  # that a stream gave up the ranks' output lock (said once)

    @property
    def done(self) -> bool:
        return not self.streams and not self.ends

    def open(self) -> list[int]:
        """The write ends the rank gets as its stdout and stderr."""
        for sink in SINKS:  # one by one: close() closes those made, should the next fail
            self.ends.append(_output_ends(sink))
        return [write_end for _, write_end in self.ends]

    def close(self) -> None:
        """The rank could not start: every end is closed."""
        close_all([fd for pair in self.ends for fd in pair])
        self.ends = []

    def forward(self) -> None:
        """The rank has started (with its ends): pass its streams on."""
        for (read_end, write_end), sink in zip(self.ends, SINKS, strict=False):  # none under --output-filename
            os.close(write_end)
            os.set_blocking(read_end, False)
            self.streams[read_end] = LineWriter(sink, self.prefix, self.several, self.lock, aside=self.aside)
            if not self.prefix and os.isatty(sink):  # someone may read as the rank writes: a prompt is not held back
                self.prompts[read_end] = None
            self.loop.watch(read_end, functools.partial(self._copy, read_end))
        self.ends = []

    def drain(self) -> None:
        """After the rank's end (and DRAIN_TIMEOUT) its streams are closed (a process that left its group may hold
        them open), once what they hold is passed on: all the rank wrote (our own reader may have been slow)."""
        for fd in list(self.streams):
            with contextlib.suppress(OSError):
                os.set_blocking(fd, True)
                left = unread(fd)
                while left > 0 and (data := os.read(fd, min(left, 65536))) and self.streams[fd].feed(data):
                    left -= len(data)
            self._close(fd)

    def _copy(self, fd: int) -> None:
        writer = self.streams[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:  # a terminal's end: EIO once the rank's side is closed, its output read
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data or not writer.feed(data):
            self._close(fd)  # end of the stream, or our own output is gone: the rank gets EPIPE
            if writer.failure is not None:
                say(f"mpsrun: {self.name}: its output could not be passed on ({writer.failure}); the rest is "
                    "dropped")
            return
        if writer.lock_given_up and not self.lock_said:
            self.lock_said = True
            say(f"mpsrun: {self.name}: the ranks' output lock was held {OUTPUT_LOCK_PATIENCE:g} s by a process "
                "that writes nothing (one a rank left running?); these lines go without it")
        if fd in self.prompts and writer.partial_since != self.prompts[fd]:
            since = self.prompts[fd] = writer.partial_since
            if since is not None:
                self.loop.after(PARTIAL_LINE_WAIT, lambda: self._prompt_due(fd, writer, since))

    def _prompt_due(self, fd: int, writer: LineWriter, since: float) -> None:
        """A partial line to a terminal has waited PARTIAL_LINE_WAIT: what the rank wrote since is read first (the
        rest of the line may be there), then what is still partial is written as it is (a prompt, a progress bar)."""
        if self.streams.get(fd) is writer:
            self._copy(fd)
        if self.streams.get(fd) is writer and writer.partial_since == since:
            writer.flush_partial()
            self.prompts[fd] = None

    def _close(self, fd: int) -> None:
        writer = self.streams.pop(fd)
        self.prompts.pop(fd, None)
        self.loop.unwatch(fd)
        writer.finish()
        os.close(fd)


def _output_ends(sink: int) -> tuple[int, int]:
    """The read and write ends of a rank's stream to ``sink``: a terminal of its own where ``sink`` is one, else a
    pipe."""
    if os.isatty(sink):
        with contextlib.suppress(OSError):  # no pseudo-terminals to be had (a container without devpts): a pipe
            read_end, write_end = os.openpty()
            try:
                _like_terminal(write_end, sink)
            except OSError:
                close_all([read_end, write_end])
                raise
            return read_end, write_end
    return os.pipe()


def _like_terminal(fd: int, terminal: int) -> None:
    """Make the terminal ``fd`` pass the rank's bytes on as they are (no newline made a carriage return and newline),
    with the size of ``terminal`` (progress bars fit their width to it)."""
    attributes = termios.tcgetattr(fd)
    attributes[1] &= ~termios.OPOST
    termios.tcsetattr(fd, termios.TCSANOW, attributes)
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, fcntl.ioctl(terminal, termios.TIOCGWINSZ, bytes(8)))


def output_files(output_dir: str, name: str) -> list[int]:
    """``--output-filename``: the stdout and stderr files of ``name`` (``rank.3``, ``task.17``) in ``output_dir``,
    made with the user's umask."""
    directory = os.path.join(output_dir, name)
    os.makedirs(directory, exist_ok=True)
    files: list[int] = []
    try:
        for stream in ("stdout", "stderr"):  # not blocking to open: a FIFO there with no reader is ENXIO, no hang
            files.append(os.open(os.path.join(directory, stream),
                                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o666))
            os.set_blocking(files[-1], True)
    except OSError:
        close_all(files)
        raise
    return files
