"""Under ``--hosts``: the hosts' agents, as the job's command hears them over TCP.

Each host's node keeper (:mod:`mpsrun.agent.keeper`) joins here with the job's token and reports its ranks' starts,
their ends with their accounts, its findings, interrupts and last words; the command (:class:`~mpsrun.job.run.Job`,
the agents' :class:`~mpsrun.agent.agent.Top`) decides, and sends each agent its stop. A host whose agent's link is
lost (the host died, or was cut off the network) loses its running ranks.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from mpsrun.agent.agent import Top
from mpsrun.agent.ranks import Doorway
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.constants import NODE_CLOSE_WAIT, RELAYED_INTERRUPT_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.files import publish
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.protocol import (
    Admitted,
    Ended,
    Found,
    Hello,
    Interrupted,
    Link,
    Listener,
    Message,
    Note,
    Peaks,
    Refusal,
    SignalRanks,
    Started,
    Stop,
)

__all__ = ["HostAgents", "listen_address", "unheard"]


def listen_address(hosts: Sequence[str], deadline: Deadline) -> str:
    """Where the command of a job over ``hosts`` (names or addresses) listens: this host's address on the way to
    them, as the kernel would send from it; one other than loopback where some are reached over loopback and the
    rest one other way. Every interface ("") only where they are reached over several, none resolves (the launcher
    then says why), or the names take past ``deadline`` to resolve (the job's --timeout then says so)."""
    found: set[str] = set()
    for host in dict.fromkeys(hosts):
        if deadline.expired():  # (each name can cost a resolver's timeout)
            return ""
        try:
            target = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # a UDP connect sends nothing: it picks the route and the source address
                found.add(str(probe.getsockname()[0]))
        except OSError:
            continue
    beyond = {address for address in found if not address.startswith("127.")}
    return next(iter(found)) if len(found) == 1 else next(iter(beyond)) if len(beyond) == 1 else ""


def unheard(hosts: Sequence[str], heard: set[str]) -> list[str]:
    """The other hosts, of ``hosts`` as ``--hosts`` names them, from which no agent came (an agent names its host by
    its own host name; names are compared short). This host is left out: its launcher starts it without a remote
    shell, and when the launcher failed elsewhere first, its agent never came either."""
    here = {_short(name) for name in heard} | {"localhost", _short(socket.gethostname())}
    return [host for host in hosts if _short(host) not in here and not _loopback(host)]


def _short(name: str) -> str:
    return name.split(".", 1)[0]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


class HostAgents:
    """The hosts' agents, joining on ``listener`` (TCP) with the job's ``token``; their events go to ``top``
    (which also hears :meth:`closed` when the last link ends); each rank's host, pid and peak device memory are
    published in ``usage_file`` for ``mpsrun top`` on this host; ``closed``: the last agent has closed, or they are
    given up."""

    def __init__(self, loop: EventLoop, listener: Listener, token: str, top: Top, usage_file: Path,
                 closed: Callable[[], None]) -> None:
        self.loop, self.listener, self.top, self.usage_file, self._closed = loop, listener, top, usage_file, closed
        self.doorway = Doorway(loop, listener, token, self._hello, self._message, self._lost)
        self.links: dict[Link, str] = {}  # each open agent's link, and its host
        self.heard: set[str] = set()  # the hosts whose agents said hello
        self.where: dict[int, tuple[Link, str, int]] = {}  # each started rank's agent, host and pid
        self.ended: set[int] = set()
        self.peaks: dict[int, int] = {}
        self.notes: list[str] = []  # what the agents had to say, for the job's end
        self.overdue = False  # the agents' closing is no longer waited for
        self.stopped: Stop | None = None  # the job's stop, for an agent that joins after it
        self._publish_due = False

    @property
    def done(self) -> bool:
        """Every agent has closed (its session is gone), or is late."""
        return not self.links or self.overdue

    def unheard(self, hosts: Sequence[str]) -> list[str]:
        """Of ``hosts``, those from which no agent came."""
        return unheard(hosts, self.heard)

    def stop(self, sig: int, exit_code: int | None) -> None:
        """Every agent stops its ranks with ``sig``; ``exit_code``: the job's, once it failed. An agent that joins
        later (a signal came while the hosts' agents started) is told at once."""
        self.stopped = Stop(sig, exit_code)
        for link in self.links:
            link.send(self.stopped)

    def forward(self, sig: int) -> None:
        """Pass a signal on to every rank (SIGUSR1 and SIGUSR2)."""
        for link in self.links:
            link.send(SignalRanks(sig))

    def close_soon(self) -> None:
        """Every rank has ended: the agents close their sessions within NODE_CLOSE_WAIT, or are late."""
        self.loop.after(NODE_CLOSE_WAIT, self._late)

    def give_up(self) -> None:
        """The ranks still silent long after their SIGKILL are lost, and their agents (stopped, or their hosts are
        gone) are waited for no more."""
        for rank, (_, host, pid) in sorted(self.where.items()):
            if rank not in self.ended:
                self.ended.add(rank)
                self.top.rank_ended(Ended(rank, None, "no word from it after SIGKILL", host=host, pid=pid))
        self._late()

    def _late(self) -> None:
        self.overdue = True
        self._closed()

    def close(self) -> None:
        for link in list(self.links):
            self.doorway.close(link)
        self.listener.close()

    def _hello(self, link: Link, hello: Hello) -> None:
        if hello.role != "node":  # a rank's supervisor joins its host's agent, not the command
            link.send(Refusal(ExitCode.SETUP, f"mpsrun: error: rank {hello.rank} came to the job's controller, not to "
                              "its node's keeper"))
            self.doorway.close(link)
            return
        link.admit()
        self.links[link] = hello.node
        self.heard.add(hello.node)
        link.send(Admitted())
        if self.stopped is not None:
            link.send(self.stopped)

    def _message(self, link: Link, message: Message) -> None:
        top = self.top
        if isinstance(message, Started):
            self.where[message.rank] = (link, message.host, message.pid)
            top.rank_started(message)
            self._publish_soon()
        elif isinstance(message, Ended) and message.rank not in self.ended:
            self.ended.add(message.rank)
            top.rank_ended(message)
        elif isinstance(message, Found):
            top.failed(ExitCode.SETUP if message.code is None else message.code, message.message) if message.fatal \
                else top.warned(message.message)
        elif isinstance(message, Note):
            self.notes.append(message.text)
        elif isinstance(message, Peaks):
            self.peaks.update({int(rank): peak for rank, peak in message.peaks.items() if rank.isdecimal()})
            self._publish_soon()
        elif isinstance(message, Interrupted):  # heard a little later: when a host dies, the launcher stops the other
            # hosts' ranks too, and the dead host's lost link, a moment behind, is the cause to say
            self.loop.after(RELAYED_INTERRUPT_WAIT, lambda: top.interrupted(message.signal, id(link)))

    def _lost(self, link: Link) -> None:
        """An agent's link has ended: once it closed its session, or with its host; its ranks still running are
        lost."""
        node = self.links.pop(link, "")
        for rank, (owner, host, pid) in sorted(self.where.items()):
            if owner is link and rank not in self.ended:
                self.ended.add(rank)
                self.top.rank_ended(Ended(rank, None, "its node keeper is gone", host=host or node, pid=pid))
        if not self.links:
            self._closed()

    def _publish_soon(self) -> None:
        """One write for all that changed in this turn of the loop (a thousand ranks start in a few turns)."""
        if not self._publish_due:
            self._publish_due = True
            self.loop.after(0, self._publish)

    def _publish(self) -> None:
        """Where each rank runs and its peak device memory so far, as the hosts' agents said, in the job's session
        directory (``mpsrun top`` on this host shows the other hosts' ranks from it)."""
        self._publish_due = False
        publish(self.usage_file, {str(rank): {"host": host, "pid": pid, "peak": self.peaks.get(rank)}
                                  for rank, (_, host, pid) in sorted(self.where.items())})
