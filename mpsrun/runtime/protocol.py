"""How rank supervisors, node keepers and the job's controller talk: typed messages as JSON lines over a socket.

A controller listens on a UNIX socket in its private session directory (one node), or on TCP for jobs over several
hosts. Every message is one of the classes below, declared once with its fields and their types; :data:`MESSAGES`
names them on the wire (``{"type": "hello", ...}``). Both ends use that declaration: :func:`encode` writes a message
object, and :func:`decode` builds one only from a line whose every field has the declared type (anything else is
dropped, so no handler sees a field of the wrong type). A peer's first message must carry the job's token; until a
link is :meth:`admitted <Link.admit>`, a line may be at most :data:`HELLO_MAX` bytes, so a stranger who reaches a TCP
port gets nothing parsed that it could make large. The annotations here are evaluated (no ``from __future__ import
annotations``): :func:`decode` checks values against them.
"""

import contextlib
import functools
import json
import os
import select
import socket
import struct
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, get_args, get_origin

from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.constants import CONNECT_TIMEOUT
from mpsrun.runtime.deadline import Deadline, backoff
from mpsrun.runtime.keepalive import keep_alive
from mpsrun.runtime.processes import pidfd

__all__ = ["HELLO_MAX", "LINE_MAX", "MESSAGES", "Admitted", "Ended", "Exited", "Found", "Hello", "Interrupted",
           "Link", "Listener", "Message", "Note", "Peaks", "Refusal", "Say", "SignalRanks", "Started", "Stop",
           "Verdict", "Welcome", "connect", "decode", "encode", "new_token"]

HELLO_MAX = 1 << 16  # a peer that has not shown the token: its hello, and nothing longer
LINE_MAX = 1 << 24  # an admitted peer that sends more without a newline is not one of ours (a welcome carries
# the caller's environment, which Linux lets grow to a quarter of the stack limit: 2 MiB by default)


# -- up: from a rank supervisor to its node's agent, or under --hosts from an agent to the job's command --------------

class Hello(NamedTuple):
    """A peer's first word: a rank's supervisor (``role`` "rank", with its identity) or a node's agent ("node", with
    its host's name)."""

    role: str
    token: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    devices: str | None = None  # the CUDA_VISIBLE_DEVICES the rank was started with
    settings: str = ""  # --per-node: the options the rank was started with (JobConfig.settings, as JSON)
    node: str = ""


class Started(NamedTuple):
    """A rank's program started: its pid and start time (``start``: clock ticks after boot, from /proc)."""

    rank: int
    pid: int
    start: int | None = None
    host: str = ""


class Exited(NamedTuple):
    """A rank's program ended (its supervisor's word): its returncode, why where the supervisor can tell, the
    supervisor's pid for a program that never started (the process that ends with its code), whether it called
    MPI_Abort, and its seconds running and of CPU."""

    rank: int
    returncode: int
    reason: str = ""
    pid: int | None = None
    aborting: bool = False
    wall: float | None = None
    cpu: float | None = None


class Ended(NamedTuple):
    """Under --hosts, an agent's word on one of its ranks' end (``returncode`` None: lost unreported), with its
    account (``mpsrun.agent.account``: memory in MiB, times in seconds)."""

    rank: int
    returncode: int | None
    reason: str = ""
    aborting: bool = False
    host: str = ""
    pid: int | None = None
    gpu: int | None = None
    mps: bool | None = None
    memory_peak: int | None = None
    memory_limit: int | None = None
    memory_share: int | None = None
    thread_percentage: int | None = None
    wall: float | None = None
    cpu: float | None = None


class Interrupted(NamedTuple):
    """A stopping signal reached a rank's supervisor (or an agent) from outside."""

    signal: int


class Found(NamedTuple):
    """An agent's finding for the job's command (``fatal``: it fails the job, with ``code``)."""

    message: str
    fatal: bool
    code: int | None = None


class Note(NamedTuple):
    """A line an agent has for the job's summary."""

    text: str


class Peaks(NamedTuple):
    """An agent's ranks' peak device memory so far (MiB, by rank), for ``mpsrun top`` on the job's host."""

    peaks: dict[str, int]


# -- down: an agent's (or the command's) answers and orders ---------------------------------------------------------

class Welcome(NamedTuple):
    """A rank admitted: its environment and how its supervisor runs it (from :func:`mpsrun.agent.welcome.welcome`).

    ``env``: mpsrun's own variables; ``defaults``: groups of variables each given only where the caller set none of
    the group; ``managed``: mpsrun's variables to drop from the caller's; ``restore``: what a launcher rewrote
    of the caller's environment, put back (None: unset); ``gpu_clients``: the MPS clients on the rank's GPU, where
    it sees one GPU, and ``gpu_queues`` the hardware queues they share; ``lines``: said once by this rank."""

    env: dict[str, str]
    defaults: list[dict[str, str]]
    managed: list[str]
    restore: dict[str, str | None]
    tag: bool
    grace: float
    timeout: float | None
    mpi4py_abort: bool
    output_lock: str | None
    output_dir: str | None
    gpu_clients: int | None
    gpu_queues: int | None
    lines: list[str]


class Admitted(NamedTuple):
    """A node's agent was taken (under --hosts), or a node's agent is ready (to the rank that started it)."""


class Refusal(NamedTuple):
    """A peer not admitted. ``retry``: come again (to a new agent); ``linger``: the node's last rank waits until its
    agent is gone; ``failed``: the agent could not start, ``heard`` by the rank that started it."""

    exit_code: int = ExitCode.SETUP
    message: str = ""
    retry: bool = False
    linger: bool = False
    failed: bool = False
    heard: bool = False


class SignalRanks(NamedTuple):
    """Pass ``signal`` to the link's rank."""

    signal: int


class Stop(NamedTuple):
    """The job's command to an agent: stop the ranks with ``signal``; ``exit_code``: the job's, once it failed."""

    signal: int
    exit_code: int | None = None


class Verdict(NamedTuple):
    """How the job ended for a rank: its exit code and lines to say. ``linger``: wait (LINGER_TIMEOUT at most) until
    the agent lets the rank go, closing its link once every rank of the node has ended, so that the node's ranks
    leave their MPI launcher together (MPICH's Hydra spins a core from the first exit of its processes to the
    last); ``outlive``: then until the agent's process is gone (a node keeper: the launcher's end means a clean
    node); ``last``: the node keeper's last rank, which speaks for the node's end (a signal meanwhile is its own;
    to a rank that only waits for the others, it is theirs)."""

    exit_code: int
    lines: list[str] = []  # noqa: RUF012 - never changed: a NamedTuple's default is shared
    linger: bool = False
    outlive: bool = False
    last: bool = False


class Say(NamedTuple):
    """An agent's word for the user, said by the rank's supervisor."""

    text: str


Message = (Hello | Started | Exited | Ended | Interrupted | Found | Note | Peaks | Welcome | Admitted | Refusal
           | SignalRanks | Stop | Verdict | Say)
MESSAGES: dict[str, type[Message]] = {
    "hello": Hello, "started": Started, "exited": Exited, "ended": Ended, "interrupted": Interrupted,
    "finding": Found, "note": Note, "peaks": Peaks, "welcome": Welcome, "admitted": Admitted, "refuse": Refusal,
    "signal": SignalRanks, "stop": Stop, "verdict": Verdict, "say": Say}
_KIND = {cls: kind for kind, cls in MESSAGES.items()}


@functools.cache
def _checker(hint: object) -> Callable[[object], bool]:
    """Whether a decoded JSON value has the declared type ``hint`` (a bool is not a number; an int is a float), as a
    test worked out once per type: a welcome carries the caller's whole environment, checked at both ends."""
    if hint is object:
        return lambda value: True
    origin, args = get_origin(hint), get_args(hint)
    if origin is types.UnionType:
        arms = [_checker(arm) for arm in args]
        return lambda value: any(arm(value) for arm in arms)
    if origin is dict:
        key, item = _checker(args[0]), _checker(args[1])
        return lambda value: isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
    if origin is list:
        item = _checker(args[0])
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    kinds = (int, float) if hint is float else hint
    return lambda value: isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))  # type: ignore


def _checked(cls: type[Message], fields: dict[str, Any]) -> Message | None:
    """``cls`` made of ``fields`` (unknown names ignored), or None when one is missing or of another type."""
    hints = cls.__annotations__
    known: dict[str, Any] = {name: fields[name] for name in cls._fields if name in fields}
    if any(name not in known for name in cls._fields if name not in cls._field_defaults):
        return None
    if not all(_checker(hints[name])(value) for name, value in known.items()):
        return None
    return cls(**known)


def encode(message: Message) -> bytes:
    """One message as a line; ValueError for one whose fields are not as declared (a bug of ours)."""
    fields = message._asdict()
    if _checked(type(message), fields) is None:
        raise ValueError(f"not a {_KIND[type(message)]!r} message as declared: {message!r}")
    return json.dumps({"type": _KIND[type(message)], **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Message | None:
    """The message in ``line``, or None when it is not JSON or not a declared message."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested deeper than Python parses
        return None
    if not isinstance(data, dict):
        return None
    cls = MESSAGES.get(data.get("type"))  # type: ignore[arg-type]
    return None if cls is None else _checked(cls, data)


def new_token() -> str:
    """The job's secret, as ``secrets.token_hex(16)`` makes one (without hashlib and OpenSSL in every supervisor)."""
    return os.urandom(16).hex()


class Link:
    """One connected peer. :meth:`send` and :meth:`receive` never raise.

    A failed send only marks the link broken: the socket stays open (and registered with whoever waits on it) until
    :meth:`receive` sees its end, so the loss is always noticed. At its end the socket still stays open, until its
    owner has stopped waiting on it and calls :meth:`close`: closed first, the descriptor's number could be reused
    while a forked child still held the socket, and an event loop would take the old socket's events for the new
    descriptor's (the kernel drops a registration only once no process holds it).

    Open files may come with a message over a Unix socket (a rank's supervisor gets the job's stdout and stderr with
    its welcome): with ``keep_descriptors`` they are kept until :meth:`take_descriptors`, else closed on arrival.
    """

    def __init__(self, sock: socket.socket, line_max: int = LINE_MAX, keep_descriptors: bool = False) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # kept after close, to stop waiting on it
        self.closed = self.broken = False
        self.ended = False  # the peer's end was read
        self.admitted = False  # the peer has shown the job's token
        self._line_max = line_max
        self._buffer = b""
        self.held: list[Message] = []  # what came after the message :meth:`expect` waited for, for :meth:`receive`
        # Descriptors that came with the messages (over a Unix socket), until taken; None: closed on arrival, so
        # nobody else's are held open here.
        self._descriptors: list[int] | None = [] if keep_descriptors else None

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def usable(self) -> bool:
        return not (self.closed or self.broken or self.ended)

    def admit(self) -> None:
        """The peer has shown the job's token: it may send lines of any length."""
        self.admitted = True
        self._line_max = LINE_MAX

    def send(self, message: Message, descriptors: Sequence[int] = ()) -> bool:
        """``descriptors``: open files the peer gets with the message (over a Unix socket)."""
        data = encode(message)
        if not self.usable:
            return False
        try:
            if descriptors:  # they travel with the first bytes
                data = data[socket.send_fds(self.sock, [data], list(descriptors)):]
            self.sock.sendall(data)
        except OSError:
            self.broken = True
            return False
        return True

    def receive(self) -> list[Message] | None:
        """The messages that have arrived (call when readable, or when messages are :attr:`held`); None once the
        peer is gone (then stop waiting on the link, and :meth:`close` it)."""
        if self.held:
            held, self.held = self.held, []
            return held
        if self.closed or self.ended:
            return None
        try:
            data = self._recv()
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

    def take_descriptors(self) -> list[int]:
        """The descriptors that came so far, now the caller's to close; any later ones are closed on arrival."""
        taken, self._descriptors = self._descriptors or [], None
        return taken

    def _recv(self) -> bytes:
        if self.sock.family != socket.AF_UNIX:
            return self.sock.recv(65536)
        data, descriptors, _, _ = socket.recv_fds(self.sock, 65536, 2)
        if self._descriptors is not None:
            self._descriptors += descriptors
        else:
            for fd in descriptors:
                os.close(fd)
        return data

    def expect(self, kinds: tuple[type[Message], ...], deadline: Deadline,
               others: Callable[[Message], object] | None = None) -> Message | None:
        """Block until a message of one of these kinds arrives, or None (``()``: wait for the peer's end); the others
        before it go to ``others`` (or are dropped), those that came with it are :attr:`held` for :meth:`receive`
        (a command's stop that follows its admission at once)."""
        while not self.closed and not deadline.expired():
            self.sock.settimeout(max(0.001, deadline.remaining()))
            messages = self.receive()
            if messages is None:
                self.close()  # a blocking wait: nothing else waits on it
                return None
            self.sock.settimeout(None)
            for index, message in enumerate(messages):
                if isinstance(message, kinds):
                    self.held = messages[index + 1:]
                    return message
                if others is not None:
                    others(message)
        return None

    def outlive_peer(self, deadline: Deadline, others: Callable[[Message], object] | None = None,
                     until_gone: bool = True) -> None:
        """Wait until the peer closes the link and, ``until_gone``, until its process is gone: a process's
        descriptors close a moment before it ends. Where the kernel cannot name the peer (another host, another
        pid namespace), the link's end is all there is to wait for."""
        process = self._peer_process() if until_gone else None
        try:
            self.expect((), deadline, others)
            if process is not None:
                select.select([process], [], [], max(0.0, deadline.remaining()))
        finally:
            if process is not None:
                os.close(process)

    def _peer_process(self) -> int | None:
        """A pidfd of the process at the other end of a Unix socket (taken while the link is open, so the pid is
        still that process's)."""
        if self.closed or self.sock.family != socket.AF_UNIX:
            return None
        try:
            pid, _, _ = struct.unpack("3i", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))
        except OSError:
            return None
        return pidfd(pid) if pid > 0 else None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


class Listener:
    """A listening socket: ``unix:PATH``, or ``tcp:ADDRESS`` (a free port there; ``tcp``: any; the token guards it)."""

    def __init__(self, where: str) -> None:
        if where.startswith("unix:"):
            self.path: str | None = where[5:]
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.bind(self.path)
            except OSError as exc:  # said with the path (bind's error names none)
                self.sock.close()
                raise OSError(exc.errno, exc.strerror, self.path) from None
            self.address = where
        else:
            self.path = None
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((where[4:], 0))
            self.address = f"tcp:{where[4:] or socket.gethostname()}:{self.sock.getsockname()[1]}"
        self.sock.listen(socket.SOMAXCONN)  # every rank of a job may connect at once

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Link | None:
        """The next peer, limited to a hello's length until it is admitted; None if it went meanwhile."""
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        keep_alive(conn)
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


def connect(address: str, timeout: float = CONNECT_TIMEOUT, keep_descriptors: bool = False) -> Link:
    """Connect to ``unix:PATH`` or ``tcp:HOST:PORT``; raises OSError. ``keep_descriptors``: see :class:`Link`."""
    if address.startswith("unix:"):
        sock = _connect_unix(address[5:], Deadline(timeout))
    elif address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        if not port.isdecimal():
            raise OSError(f"not a controller address: {address!r}")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        keep_alive(sock)
    else:
        raise OSError(f"not a controller address: {address!r}")
    sock.settimeout(None)
    return Link(sock, keep_descriptors=keep_descriptors)
