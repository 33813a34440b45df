"""How rank supervisors, node keepers and the job's controller talk: JSON lines over a stream socket.

A controller listens on a UNIX socket in its private session directory (one node), or on TCP for jobs
over several hosts. Every message is a JSON object with a ``type``, declared once in :data:`MESSAGES`
with its fields and their types: both ends use that declaration, :meth:`Link.send` for what it writes and
:meth:`Link.receive` for what it accepts (a message that does not match is dropped, so no handler sees a
field of the wrong type). A peer's first message must carry the job's token; until a link is
:meth:`admitted <Link.admit>`, a line may be at most :data:`HELLO_MAX` bytes, so a stranger who reaches a
TCP port gets nothing parsed that it could make large.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from mpsrun.runtime.constants import CONNECT_TIMEOUT
from mpsrun.runtime.deadline import Deadline, backoff

__all__ = ["HELLO_MAX", "LINE_MAX", "MESSAGES", "Link", "Listener", "connect", "decode", "encode", "new_token"]

HELLO_MAX = 1 << 16  # a peer that has not shown the token: its hello, and nothing longer
LINE_MAX = 1 << 24  # an admitted peer that sends more without a newline is not one of ours (a welcome carries
# the caller's environment, which Linux lets grow to a quarter of the stack limit: 2 MiB by default)
_OPTIONAL = type(None)


class Message(NamedTuple):
    """One message type: who sends it (``up``: to the controller; ``down``: from it), the fields it must carry
    and those it may, each with its type(s)."""

    direction: str
    required: Mapping[str, type | tuple[type, ...]]
    optional: Mapping[str, type | tuple[type, ...]] = {}


_NUMBER = (int, float)
MESSAGES: dict[str, Message] = {
    # up: a rank supervisor, or under --hosts a node keeper relaying for its ranks
    "hello": Message("up", {"role": str, "token": str},
                     {"identity": dict, "host": str, "shim": int, "devices": (str, _OPTIONAL), "settings": dict,
                      "node": str}),
    "started": Message("up", {"rank": int, "pid": int}, {"start": (int, _OPTIONAL), "host": str}),
    "exited": Message("up", {"rank": int, "returncode": (int, _OPTIONAL)},
                      {"reason": str, "pid": (int, _OPTIONAL), "aborting": bool}),
    "interrupted": Message("up", {"signal": int}, {"rank": int}),
    "finding": Message("up", {"message": str, "fatal": bool}, {"code": int}),
    "note": Message("up", {"text": str}),
    # down: the controller's answers and orders
    "welcome": Message("down", {}, {"env": dict, "managed": list, "restore": dict, "tag": bool, "grace": _NUMBER,
                                    "mpi4py_abort": bool, "output_lock": (str, _OPTIONAL),
                                    "output_dir": (str, _OPTIONAL), "lines": list}),
    "refuse": Message("down", {}, {"exit_code": int, "message": str, "retry": bool, "linger": bool, "failed": bool}),
    "signal": Message("down", {"signal": int}, {"ranks": list}),
    "verdict": Message("down", {"rank": int, "exit_code": int}, {"lines": list, "linger": bool}),
    "say": Message("down", {"text": str}),
}


def _typed(value: object, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def conforms(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is one of :data:`MESSAGES`, with every field it needs and each of the declared type."""
    spec = MESSAGES.get(message.get("type"))  # type: ignore[arg-type]
    if spec is None:
        return False
    fields = {**spec.optional, **spec.required}
    return all(name in message for name in spec.required) and all(
        _typed(value, fields[name]) for name, value in message.items() if name in fields)


def encode(kind: str, **fields: Any) -> bytes:
    """One message as a line; ValueError for one that :data:`MESSAGES` does not declare (a bug of ours)."""
    message = {"type": kind, **fields}
    if not conforms(message):
        raise ValueError(f"not a {kind!r} message as MESSAGES declares it: {message!r}")
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any] | None:
    """The message in ``line``, or None when it is not JSON or not a declared message."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested deeper than Python parses
        return None
    return message if isinstance(message, dict) and conforms(message) else None


def new_token() -> str:
    """The job's secret, as ``secrets.token_hex(16)`` makes one (without hashlib and OpenSSL in every supervisor)."""
    return os.urandom(16).hex()


class Link:
    """One connected peer. :meth:`send` and :meth:`receive` never raise.

    A failed send only marks the link broken: the socket stays open (and registered with
    whoever waits on it) until :meth:`receive` sees its end, so the loss is always noticed.
    At its end the socket still stays open, until its owner has stopped waiting on it and
    calls :meth:`close`: closed first, the descriptor's number could be reused while a forked
    child still held the socket, and an event loop would take the old socket's events for
    the new descriptor's (the kernel drops a registration only once no process holds it).
    """

    def __init__(self, sock: socket.socket, line_max: int = LINE_MAX) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # kept after close, to stop waiting on it
        self.closed = False
        self.broken = False
        self.ended = False  # the peer's end was read
        self.peer: dict[str, Any] = {}  # who the peer is, once admitted
        self._line_max = line_max
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def usable(self) -> bool:
        return not (self.closed or self.broken or self.ended)

    def admit(self, **peer: Any) -> None:
        """The peer has shown the job's token: it is ``peer`` from now on, and may send lines of any length."""
        self.peer = dict(peer)
        self._line_max = LINE_MAX

    def send(self, kind: str, **fields: Any) -> bool:
        data = encode(kind, **fields)
        if not self.usable:
            return False
        try:
            self.sock.sendall(data)
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
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        if len(self._buffer) > self._line_max or any(len(line) > self._line_max for line in lines):
            self.ended = True  # not one of ours: it is dropped as if it had gone
            return None
        return [message for line in lines if (message := decode(line)) is not None]

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
                if message["type"] in kinds:
                    return message
                if others is not None:
                    others(message)
        return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


class Listener:
    """A listening socket: ``unix:PATH``, or ``tcp`` (every interface, a free port; the token guards it)."""

    def __init__(self, where: str) -> None:
        if where.startswith("unix:"):
            self.path: str | None = where[5:]
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(self.path)
            self.address = where
        else:
            self.path = None
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("", 0))
            self.address = f"tcp:{socket.gethostname()}:{self.sock.getsockname()[1]}"
        self.sock.listen(socket.SOMAXCONN)  # every rank of a job may connect at once

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Link | None:
        """The next peer, limited to a hello's length until it is admitted; None if it went meanwhile."""
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        conn.setblocking(True)
        return Link(conn, line_max=HELLO_MAX)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _connect_unix(path: str, deadline: Deadline) -> socket.socket:
    """Connect, waiting while the listener's backlog is full (EAGAIN: hundreds of ranks join at once)."""
    for pause in backoff():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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


def connect(address: str, timeout: float = CONNECT_TIMEOUT) -> Link:
    """Connect to ``unix:PATH`` or ``tcp:HOST:PORT``; raises OSError."""
    if address.startswith("unix:"):
        sock = _connect_unix(address[5:], Deadline(timeout))
    elif address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        if not port.isdecimal():
            raise OSError(f"not a controller address: {address!r}")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    else:
        raise OSError(f"not a controller address: {address!r}")
    sock.settimeout(None)
    return Link(sock)
