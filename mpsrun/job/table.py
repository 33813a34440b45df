"""The ranks of a job as a controller hears of them: who joined over which link, their processes, their ends.

This is the protocol side of the controller (:mod:`mpsrun.job.controller` decides): it accepts
rank supervisors and node keepers on the listener, checks the job's token, keeps one
:class:`RankState` per rank, and turns messages (and lost links) into events.
"""

from __future__ import annotations

import contextlib
import hmac
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpsrun.exitcodes import ExitCode, Outcome, exit_code
from mpsrun.job.outcome import RankEnd
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import HELLO_WAIT, RELAYED_INTERRUPT_WAIT, STOP_SIGNALS
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.processes import ProcessRef, kill_group
from mpsrun.runtime.protocol import (
    Admitted,
    Exited,
    Found,
    Hello,
    Interrupted,
    Link,
    Listener,
    Note,
    Peaks,
    Peer,
    Refusal,
    Started,
)

if TYPE_CHECKING:
    from mpsrun.job.placement import RankPlan

__all__ = ["RankEvents", "RankState", "RankTable", "refuse_newcomer"]


def token_matches(offered: object, token: str) -> bool:
    """The token a rank offered is the job's (compared in constant time)."""
    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), token.encode())


def _from_node(link: Link) -> bool:
    return link.peer is not None and link.peer.role == "node"


def refuse_newcomer(link: Link, refusal: Refusal) -> None:
    """Answer a peer that connected but was not yet heard with ``refusal``, once its hello (sent right after
    connecting) is read, and close the link: a peer that meets a closed link without an answer takes it for a
    crash."""
    with contextlib.suppress(OSError):
        link.expect((Hello,), Deadline(HELLO_WAIT))
        link.send(refusal)
    link.close()


@dataclass(slots=True, eq=False)
class RankState:
    """One rank as its controller knows it: the link it joined over, its process (when on this host), its end, and
    whether it has had its verdict."""

    rank: int
    link: Link | None = None
    process: ProcessRef | None = None
    end: RankEnd | None = None
    verdict_sent: bool = False
    unlimited_gpu: tuple[int, int] | None = None  # its GPU's position and ranks, shared with no memory limit
    plan: RankPlan | None = None  # where it runs and its limits (for its account), when welcomed here

    def ended(self, end: RankEnd) -> None:
        self.end = end

    def own_code(self) -> int:
        """The rank's own exit code, as its end gives it."""
        returncode = self.end.returncode if self.end is not None else 0
        return exit_code(Outcome("ok" if returncode == ExitCode.OK else "rank-failed", returncode))

    def judged(self) -> None:
        self.verdict_sent = True


class RankEvents(Protocol):
    """What the controller is told."""

    def admit(self, link: Link, identity: RankIdentity, hello: Hello) -> None: ...

    def rank_started(self, state: RankState, message: Started) -> None: ...

    def rank_ended(self, state: RankState, end: RankEnd) -> None: ...

    def interrupted(self, sig: int, source: int) -> None: ...

    def relayed(self, message: Found | Note | Peaks) -> None: ...

    def node_closed(self) -> None: ...

    def judged_before_report(self, link: Link, state: RankState) -> None: ...

    def link_closed(self, link: Link) -> None: ...


class RankTable:
    def __init__(self, loop: EventLoop, listener: Listener, token: str, events: RankEvents, host: str) -> None:
        self.loop, self.listener, self.token, self.events, self.host = loop, listener, token, events, host
        self.ranks: dict[int, RankState] = {}
        self.nodes: set[Link] = set()  # open links of node keepers (each closes once its host's session is gone)
        self.heard: set[str] = set()  # the hosts whose node keepers said hello
        self.accepting = True  # False once a node keeper closes: a rank that comes then starts a new one
        self._unheard: set[Link] = set()  # accepted, their hello not yet read
        loop.watch(listener.fileno(), self._accept)

    def add(self, state: RankState) -> RankState:
        """A rank the controller admitted, refused, or gave up before it started."""
        self.ranks[state.rank] = state
        return state

    def stop_accepting(self) -> None:
        """A node keeper is closing: a rank that says hello from now on is asked to come again (to a new one), as is
        one already connected that has yet to be heard (the loop may end before its hello is read)."""
        self.accepting = False
        for link in list(self._unheard):
            self.loop.unwatch(link.fd)
            self._unheard.discard(link)
            refuse_newcomer(link, Refusal(retry=True))

    def live(self) -> list[RankState]:
        return [s for s in self.ranks.values() if s.end is None]

    def local_pids(self) -> dict[int, int]:
        """``{pid: rank}`` for the live ranks on this host."""
        return {s.process.pid: s.rank for s in self.live() if s.process is not None}

    def ended(self, ranks: Iterable[int]) -> bool:
        return all(r in self.ranks and self.ranks[r].end is not None for r in ranks)

    def _accept(self) -> None:
        link = self.listener.accept()
        if link is not None:
            self._unheard.add(link)
            self.loop.watch(link.fd, lambda: self._on_link(link))

    def close(self, link: Link) -> None:
        self.loop.unwatch(link.fd)
        self._unheard.discard(link)
        link.close()
        self._forget_node(link)

    def _forget_node(self, link: Link) -> None:
        if link in self.nodes:
            self.nodes.discard(link)
            self.events.node_closed()

    def _on_link(self, link: Link) -> None:
        messages = link.receive()
        self._unheard.discard(link)
        if messages is None:
            self.loop.unwatch(link.fd)  # before the close: see Link
            link.close()
            self._lost(link)
            return
        for message in messages:
            if link.peer is None and not isinstance(message, Hello):
                self.close(link)  # a peer must say who it is first
                return
            if isinstance(message, Hello):
                self._hello(link, message)
            elif isinstance(message, (Started, Exited)):
                self._report(link, message)
            elif isinstance(message, Interrupted) and message.signal in STOP_SIGNALS:
                self._interrupted(link, message.signal)
            elif isinstance(message, (Found, Note, Peaks)) and _from_node(link):
                self.events.relayed(message)

    def _interrupted(self, link: Link, sig: int) -> None:
        if _from_node(link):  # see RELAYED_INTERRUPT_WAIT
            self.loop.after(RELAYED_INTERRUPT_WAIT, lambda: self.events.interrupted(sig, id(link)))
        else:
            self.events.interrupted(sig, id(link))

    def _hello(self, link: Link, hello: Hello) -> None:
        if not token_matches(hello.token, self.token):
            self.close(link)
        elif not self.accepting:
            link.send(Refusal(retry=True))
            self.close(link)
        elif hello.role == "node":  # a node keeper relaying for its ranks
            link.admit(Peer("node", node=hello.node))
            self.nodes.add(link)
            self.heard.add(hello.node)
            link.send(Admitted())
        else:
            try:
                identity = RankIdentity.from_json(hello.identity or {})
            except ValueError as exc:
                link.send(Refusal(ExitCode.SETUP, f"mpsrun: bad hello: {exc}"))
                self.close(link)
                return
            link.admit(Peer("rank", rank=identity.rank))
            self.events.admit(link, identity, hello)

    def _state_of(self, link: Link, message: Started | Exited) -> RankState | None:
        assert link.peer is not None
        rank = message.rank if link.peer.rank is None else link.peer.rank
        if _from_node(link) and rank not in self.ranks:
            self.ranks[rank] = RankState(rank, link)  # a rank a node keeper welcomed
        return self.ranks.get(rank)

    def _report(self, link: Link, message: Started | Exited) -> None:
        state = self._state_of(link, message)
        if state is None:
            return
        if state.end is not None:
            if isinstance(message, Exited) and _from_node(link):  # its node waits for a verdict all the same
                self.events.judged_before_report(link, state)
            return
        if isinstance(message, Started):
            if message.host == self.host and message.start is not None:
                state.process = ProcessRef(message.pid, message.start)
            self.events.rank_started(state, message)
            return
        # returncode None: a node keeper lost the rank without a report
        pid = state.process.pid if state.process is not None else message.pid
        relayed = message if _from_node(link) else None
        host = relayed.host if relayed is not None and relayed.host != self.host else ""  # a pid elsewhere needs it
        self.events.rank_ended(state, RankEnd(state.rank, pid, message.returncode, message.reason, message.aborting,
                                              message.wall, message.cpu, relayed, host))

    def _lost(self, link: Link) -> None:
        gone = "its node keeper is gone" if _from_node(link) else "its supervisor is gone"
        node = link.peer.node if link.peer is not None and _from_node(link) else ""
        host = node if node != self.host else ""  # a pid elsewhere needs it
        for state in [s for s in self.live() if s.link is link]:
            if state.process is not None:  # its leader died with its supervisor; end what it left
                kill_group(state.process.pid, signal.SIGKILL)
            pid = state.process.pid if state.process is not None else None
            self.events.rank_ended(state, RankEnd(state.rank, pid, None, gone, host=host))
        self._forget_node(link)
        self.events.link_closed(link)
