"""How rank shims, node keepers and the launcher talk: JSON lines over a stream socket.

Built-in modules only (:mod:`_socket` rather than :mod:`socket`: every rank supervisor and every job's
start imports this; only a TCP :func:`connect` imports ``socket``). A controller listens on a UNIX socket in
its private session directory (one node), or on TCP for jobs over several hosts; every
peer's first message carries the job's token, so a stranger that reaches a TCP port is
turned away. Messages, each a JSON object with a ``type``:

* up (rank shim or node keeper to its controller): ``hello``, ``started``, ``exited``,
  ``finding``, ``note``;
* down: ``welcome`` or ``refuse`` (the answer to ``hello``), ``signal``, ``verdict``.
"""

from __future__ import annotations

import _socket  # ``socket`` without its enums and ``selectors`` (4 ms in every rank supervisor)
import os
import time

from mpsrun.runtime import wire
from mpsrun.runtime.deadline import Deadline, backoff

TYPE_CHECKING = False  # imported by every rank supervisor: typing's and collections' imports are left out
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any

__all__ = ["Link", "Listener", "connect", "new_token"]

_MAX_LINE = 1 << 20  # a peer that sends more without a newline is not one of ours


def new_token() -> str:
    return os.urandom(16).hex()  # as secrets.token_hex(16), without importing hashlib in every shim


class Link:
    """One connected peer. :meth:`send` and :meth:`receive` never raise.

    A failed send only marks the link broken: the socket stays open (and registered with
    whoever waits on it) until :meth:`receive` sees its end, so the loss is always noticed.
    At its end the socket still stays open, until its owner has stopped waiting on it and
    calls :meth:`close`: closed first, the descriptor's number could be reused while a forked
    child still held the socket, and an event loop would take the old socket's events for
    the new descriptor's (the kernel drops a registration only once no process holds it).
    """

    def __init__(self, sock: socket.socket | _socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # kept after close, to stop waiting on it
        self.closed = False
        self.broken = False
        self.ended = False  # the peer's end was read
        self.peer: dict[str, Any] = {}  # what the peer said about itself in its hello
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def usable(self) -> bool:
        return not (self.closed or self.broken or self.ended)

    def send(self, kind: str, **fields: Any) -> bool:
        if not self.usable:
            return False
        try:
            self.sock.sendall(wire.dumps({"type": kind, **fields}).encode() + b"\n")
        except OSError:
            self.broken = True
            return False
        return True

    def receive(self) -> list[dict[str, Any]] | None:
        """The messages that have arrived (call when readable); None once the peer is gone (then
        stop waiting on the link, and :meth:`close` it)."""
        if self.closed or self.ended:
            return None
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.ended = True
            return None
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > _MAX_LINE:
            self.ended = True
            return None
        return [message for line in lines if (message := _decode(line)) is not None]

    def expect(self, kinds: tuple[str, ...], deadline: Deadline,
               others: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any] | None:
        """Block until a message of one of these kinds arrives, or None; the others before it go to ``others``
        (or are dropped)."""
        while not self.closed and not deadline.expired():
            self.sock.settimeout(max(0.001, deadline.remaining()))
            messages = self.receive()
            if messages is None:
                self.close()  # a blocking wait: nothing else waits on it
                return None
            self.sock.settimeout(None)
            for message in messages:
                if message.get("type") in kinds:
                    return message
                if others is not None:
                    others(message)
        return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _close(self.sock)


def _close(sock: socket.socket | _socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _decode(line: bytes) -> dict[str, Any] | None:
    try:
        message = wire.loads(line)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python parses
        return None
    return message if isinstance(message, dict) and isinstance(message.get("type"), str) else None


class Listener:
    """A listening socket: ``unix:PATH``, or ``tcp`` (every interface, a free port)."""

    def __init__(self, where: str) -> None:
        if where.startswith("unix:"):
            self.path: str | None = where[5:]
            self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            self.sock.bind(self.path)
            self.address = where
        else:
            self.path = None
            self.sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            self.sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            self.sock.bind(("", 0))
            self.address = f"tcp:{_socket.gethostname()}:{self.sock.getsockname()[1]}"
        self.sock.listen(_socket.SOMAXCONN)  # every rank of a job may connect at once

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Link | None:
        try:
            fd, _ = self.sock._accept()  # type: ignore[attr-defined] # _socket's accept: a descriptor (``socket`` wraps it, at 3 ms of imports)
        except OSError:
            return None
        conn = _socket.socket(fileno=fd)
        conn.setblocking(True)
        return Link(conn)

    def close(self) -> None:
        _close(self.sock)
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _connect_unix(path: str, deadline: Deadline) -> _socket.socket:
    """Connect, waiting while the listener's backlog is full (EAGAIN: hundreds of ranks join at once)."""
    for pause in backoff():
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(max(deadline.remaining(), 0.001))
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            if deadline.expired():
                raise
            time.sleep(min(pause, deadline.remaining()))
        except OSError:
            sock.close()
            raise
    raise AssertionError("unreachable")  # pragma: no cover - backoff() never ends


def connect(address: str, timeout: float = 10.0) -> Link:
    """Connect to ``unix:PATH`` or ``tcp:HOST:PORT``; raises OSError."""
    if address.startswith("unix:"):
        sock = _connect_unix(address[5:], Deadline(timeout))
    elif address.startswith("tcp:"):
        import socket  # only under --hosts

        host, _, port = address[4:].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    else:
        raise OSError(f"not a controller address: {address!r}")
    sock.settimeout(None)
    return Link(sock)
