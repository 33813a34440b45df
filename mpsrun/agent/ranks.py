"""The peers of an agent (its ranks' supervisors) or of a command (the hosts' agents): who came over which link.

A :class:`Doorway` accepts peers on a listener; each must say hello with the job's token first, and only then
may send long lines. A :class:`RankState` is one rank as its agent knows it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from mpsrun.agent.outcome import RankEnd
from mpsrun.runtime.constants import HELLO_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.processes import ProcessRef
from mpsrun.runtime.protocol import Hello, Link, Listener, Message, Refusal

if TYPE_CHECKING:
    from mpsrun.mps.placement import RankPlan

__all__ = ["Doorway", "RankState", "refuse_newcomer", "token_matches", "turn_away"]


def token_matches(offered: object, token: str) -> bool:
    """The token a peer offered is the job's (compared in constant time)."""
    import hmac  # (OpenSSL's): imported as the daemons start, not before them on every job's path

    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), token.encode())


def refuse_newcomer(link: Link, refusal: Refusal) -> None:
    """Answer a peer that connected but was not yet heard with ``refusal``, once its hello (sent right after
    connecting) is read, and close the link: a peer that meets a closed link without an answer takes it for a
    crash."""
    with contextlib.suppress(OSError):
        link.expect((Hello,), Deadline(HELLO_WAIT))
        link.send(refusal)
    link.close()


def turn_away(listener: Listener, refusal: Refusal) -> None:
    """Answer every peer still waiting in ``listener``'s backlog with ``refusal``, then close it (a peer that meets
    a closed link without an answer takes it for a crash)."""
    listener.sock.setblocking(False)
    while (link := listener.accept()) is not None:
        refuse_newcomer(link, refusal)
    listener.close()


class RankState:
    """One rank as its agent knows it: the link it joined over, its process, its plan (where it runs and its limits,
    None without GPUs), its end, and whether it has had its verdict."""

    __slots__ = ("end", "link", "plan", "process", "rank", "verdict_sent")

    def __init__(self, rank: int, link: Link | None = None, plan: RankPlan | None = None, end: RankEnd | None = None,
                 verdict_sent: bool = False) -> None:
        self.rank, self.link, self.plan, self.end, self.verdict_sent = rank, link, plan, end, verdict_sent
        self.process: ProcessRef | None = None


class Doorway:
    """Peers joining through ``listener``. A hello with the job's token goes to ``on_hello`` (which admits the link
    or closes it); every later message of an admitted link to ``on_message``; a link's end to ``on_lost``."""

    def __init__(self, loop: EventLoop, listener: Listener, token: str, on_hello: Callable[[Link, Hello], None],
                 on_message: Callable[[Link, Message], None], on_lost: Callable[[Link], None]) -> None:
        self.loop, self.listener, self.token = loop, listener, token
        self._on_hello, self._on_message, self._on_lost = on_hello, on_message, on_lost
        self.open = True  # False once its agent closes: a peer that comes is asked to come again (to a new one)
        self._unheard: set[Link] = set()  # accepted, their hello not yet read
        self._lingering: list[Link] = []  # refused peers that wait for our process's end: open until then
        loop.watch(listener.fileno(), self._accept)

    def close_door(self) -> None:
        """Admit no one more: a peer already connected and not yet heard is asked to come again (the loop may end
        before its hello is read)."""
        self.open = False
        for link in list(self._unheard):
            self.loop.unwatch(link.fd)
            self._unheard.discard(link)
            refuse_newcomer(link, Refusal(retry=True))

    def close(self, link: Link, linger: bool = False) -> None:
        """Read ``link`` no more and close it; with ``linger`` leave it open until our process ends (or
        ``let_go``): its peer waits for that end."""
        self.loop.unwatch(link.fd)
        self._unheard.discard(link)
        if linger:
            self._lingering.append(link)
        else:
            link.close()

    def let_go(self) -> None:
        """Close the links of peers that linger: they need not wait for our end any more."""
        for link in self._lingering:
            link.close()
        self._lingering.clear()

    def _accept(self) -> None:
        link = self.listener.accept()
        if link is not None:
            self._unheard.add(link)
            self.loop.watch(link.fd, lambda: self._read(link))

    def _read(self, link: Link) -> None:
        messages = link.receive()
        self._unheard.discard(link)
        if messages is None:
            self.loop.unwatch(link.fd)  # before the close: see Link
            link.close()
            if link.admitted:
                self._on_lost(link)
            return
        for message in messages:
            if link.admitted:
                self._on_message(link, message)
            elif not isinstance(message, Hello) or not token_matches(message.token, self.token):
                self.close(link)  # a peer must say who it is first, with the job's token
                return
            elif not self.open:
                link.send(Refusal(retry=True))
                self.close(link)
                return
            else:
                self._on_hello(link, message)
            if link.closed:
                return
