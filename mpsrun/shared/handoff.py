"""Handing one region of memory from the process that fills it to the others on its device.

For each shared name and device there are two files in the session's private directory: a lock
and a UNIX socket (``SOCK_SEQPACKET``). Whoever takes the lock (``flock``) is the **publisher**:
it fills the region, then answers every connection with one message (what the region is, and
its descriptor) carrying the region's file descriptor (``SCM_RIGHTS``). The others are
**subscribers**: they connect and wait for that message, with a deadline. A subscriber keeps
its connection open while it uses the region; closing it (or dying: the kernel closes it)
releases it, so the publisher knows how many still use the region. The lock is the kernel's:
it is gone with its holder, however that ends. A subscriber that sees its publisher end then
takes the lock and publishes the same region (:func:`take_over`); only when nobody holds the
region any more does the next caller fill it afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import socket
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpsrun.runtime.deadline import Deadline, poll_until

__all__ = ["HandoffError", "Publisher", "Subscription", "join", "take_over"]

MESSAGE_MAX = 1 << 16
TAKE_OVER_WAIT = 2.0  # a killed publisher's process may still hold the lock a moment after its sockets close
_open: weakref.WeakSet[Publisher | Subscription] = weakref.WeakSet()  # to let go of in a forked child


def _seconds(deadline: Deadline) -> float | None:
    """A socket timeout for ``deadline``: none without one; a ready publisher's answer is awaited at least 0.1 s."""
    return None if deadline.seconds is None else min(max(deadline.remaining(), 0.1), 1e6)


def _let_go_in_child() -> None:
    """A forked child holds copies of our lock (a flock held through it outlives us) and sockets: drop them."""
    for holder in list(_open):
        holder.forget()


class HandoffError(Exception):
    """The region could not be had: its publisher failed, or the deadline passed."""


class Publisher:
    """The lock holder's side: serves the region's message to every subscriber, counts those still connected."""

    def __init__(self, lock_fd: int, path: Path) -> None:
        self.lock_fd, self.path = lock_fd, path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead publisher's socket: we hold the lock, so it is no one's
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)  # the directory is 0700 already; the socket is the owner's alone as well
        self.listener.listen(socket.SOMAXCONN)
        self._message: tuple[bytes, list[int]] | None = None
        self._waiting: list[socket.socket] = []
        self._subscribers: set[socket.socket] = set()
        self._changed = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name=f"mpsrun-share-{path.name}", daemon=True)
        self._thread.start()
        _open.add(self)

    def forget(self) -> None:
        """In a forked child: close our copies of the lock and the sockets (the parent keeps serving)."""
        for fd in (self.lock_fd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for conn in [*self._waiting, *self._subscribers, self.listener]:
            conn.close()

    def publish(self, header: dict[str, Any], fd: int) -> None:
        """The region is ready: answer everyone waiting, and everyone who comes."""
        self._set((json.dumps({"ok": True, **header}).encode(), [fd]))

    def fail(self, reason: str) -> None:
        """The region will not be ready: every subscriber hears why."""
        self._set((json.dumps({"ok": False, "error": reason}).encode(), []))

    def _set(self, message: tuple[bytes, list[int]]) -> None:
        with self._changed:
            self._message = message
        os.write(self._wake_w, b"x")

    @property
    def subscribers(self) -> int:
        with self._changed:
            return len(self._subscribers)

    def wait_released(self, deadline: Deadline) -> bool:
        """Until no subscriber uses the region (True), or the deadline passes (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._subscribers, timeout=deadline.remaining()
                                          if deadline.seconds is not None else None)

    def close(self) -> None:
        """Stop serving: the socket's name goes first, then the lock, then the connections. A subscriber that sees
        its connection end may so find the lock free and publish the same memory at that name."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.lock_fd)
        os.write(self._wake_w, b"q")
        self._thread.join()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while self._serve_once(selector):
                pass
        for conn in [*self._waiting, *self._subscribers, self.listener]:
            conn.close()

    def _serve_once(self, selector: selectors.BaseSelector) -> bool:
        for key, _ in selector.select():
            if key.fileobj is self._wake_r:
                if b"q" in os.read(self._wake_r, 64):
                    self._answer_waiting()  # a failure said before closing still reaches those waiting
                    return False
            elif key.fileobj is self.listener:
                conn, _ = self.listener.accept()
                self._waiting.append(conn)
                selector.register(conn, selectors.EVENT_READ)
            else:
                self._gone(selector, key.fileobj)  # type: ignore[arg-type]
        self._answer_waiting()
        return True

    def _answer_waiting(self) -> None:
        with self._changed:
            message = self._message
        if message is None:
            return
        for conn in self._waiting:
            if message[1]:  # counted before it can map the region: a release() then waits for it
                with self._changed:
                    self._subscribers.add(conn)
            try:
                socket.send_fds(conn, [message[0]], message[1])
            except OSError:  # it went meanwhile: it never got the region (its end also shows as readable)
                with self._changed:
                    self._subscribers.discard(conn)
                    self._changed.notify_all()
        self._waiting = []  # answered: a refused one closes its end, which shows as readable

    def _gone(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        """A subscriber's connection was readable: it closed (released, or its process ended)."""
        with contextlib.suppress(OSError):
            if conn.recv(16):
                return  # subscribers say nothing; ignore
        selector.unregister(conn)
        conn.close()
        with self._changed:
            self._subscribers.discard(conn)
            self._changed.notify_all()
        if conn in self._waiting:
            self._waiting.remove(conn)


class Subscription:
    """A subscriber's hold on a region: what the publisher said, its descriptor (``fd``, ours to keep), and the
    connection that stands for the hold."""

    def __init__(self, conn: socket.socket, header: dict[str, Any], fd: int) -> None:
        self.conn, self.header, self.fd = conn, header, fd
        self.released = False
        _open.add(self)

    def forget(self) -> None:
        """In a forked child: close our copies (the hold stays the parent's)."""
        self.released = True
        self.conn.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def watch(self, orphaned: Callable[[], None]) -> None:
        """Call ``orphaned`` (in a thread) if the publisher ends while we still hold the region."""
        def wait() -> None:
            with contextlib.suppress(OSError):
                self.conn.recv(16)  # subscribers are never sent anything more: this returns at the end
            if not self.released:
                orphaned()

        threading.Thread(target=wait, name="mpsrun-share-watch", daemon=True).start()

    def release(self) -> None:
        self.released = True
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes the watching thread
        self.conn.close()
        os.close(self.fd)


def _lock(path: Path) -> int | None:
    """The lock's descriptor if we took it (we publish), None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _subscribe(path: Path, deadline: Deadline) -> Subscription | None:
    """Connect and wait for the publisher's message; None when no publisher listens (yet, or any more)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(str(path))
        conn.settimeout(_seconds(deadline))
        data, fds, _, _ = socket.recv_fds(conn, MESSAGE_MAX, 1)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
        conn.close()
        return None
    except TimeoutError:
        conn.close()
        raise HandoffError(f"the region was not ready within {deadline.seconds:g} s") from None
    if not data:  # the publisher ended before the region was ready: whoever locks next publishes
        conn.close()
        return None
    header = json.loads(data)
    if not header.get("ok") or not fds:
        conn.close()
        raise HandoffError(str(header.get("error") or "the publisher's message carried no descriptor"))
    conn.settimeout(None)
    return Subscription(conn, header, fds[0])


def take_over(directory: Path, key: str, subscription: Subscription) -> Publisher | None:
    """Publish, for later callers, a region we hold whose publisher has ended: the memory lives while anyone maps
    it, so they get the same copy. None if another process serves the name by then (it took over, or publishes
    anew), or we let go of ours meanwhile."""
    def attempt() -> Publisher | bool | None:  # the publisher; False: stand down; None: try again
        lock_fd = _lock(directory / f"{key}.lock")
        if lock_fd is not None:
            publisher = Publisher(lock_fd, directory / f"{key}.sock")
            publisher.publish({k: v for k, v in subscription.header.items() if k != "ok"}, subscription.fd)
            return publisher
        return False if subscription.released or _serving(directory / f"{key}.sock") else None

    result = poll_until(attempt, Deadline(TAKE_OVER_WAIT))
    return result if isinstance(result, Publisher) else None


def _serving(path: Path) -> bool:
    """Whether a live publisher listens at ``path``. A dead one's socket refuses; a dying one's may still accept,
    then closes: a live one answers at once, or (still filling) keeps the connection open."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(str(path))
        probe.settimeout(0.2)
        return bool(probe.recv(MESSAGE_MAX))
    except TimeoutError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


def join(directory: Path, key: str, deadline: Deadline) -> Publisher | Subscription:
    """Publish ``key`` in ``directory`` (we took its lock) or subscribe to whoever did, before ``deadline``."""
    lock_path, socket_path = directory / f"{key}.lock", directory / f"{key}.sock"

    def attempt() -> Publisher | Subscription | None:
        lock_fd = _lock(lock_path)
        return Publisher(lock_fd, socket_path) if lock_fd is not None else _subscribe(socket_path, deadline)

    held = poll_until(attempt, deadline)
    if not isinstance(held, (Publisher, Subscription)):
        raise HandoffError(f"no process published it within {deadline.seconds:g} s")
    return held


os.register_at_fork(after_in_child=_let_go_in_child)
