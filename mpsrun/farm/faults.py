"""A fatal GPU fault, as a farm or an executor sees it: which of the work that just failed its server tore down.

One client's fatal fault (an illegal address) ends every client of its MPS server with work in flight, and MPS does
not say reliably whose fault it was (on an H100 its log named a bystander). The server's log does name every client
it tore down. Work torn down beside other work is a suspect, to run again alone; work that faults alone, or that the
fault tore down alone, is the fault's own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping

from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.replies import torn_down_clients
from mpsrun.runtime.files import read_log

__all__ = ["Fault", "ServerFaults"]


class Fault(enum.Enum):
    """What a fatal fault means for work that failed: none of it (it failed on its own), a suspect, or its own."""

    NONE = "none"
    SUSPECT = "suspect"
    OWN = "own"


class ServerFaults:
    """The fatal faults of ``daemon``'s server, read from its log as the work it serves fails. ``whose``: the work a
    client process belongs to, where it is not the work's own process (a child of it), else None."""

    def __init__(self, daemon: ControlDaemon, whose: Callable[[int], Hashable | None]) -> None:
        self.daemon, self.whose = daemon, whose
        self._read = 0  # how far the log was read
        self._size = 0  # how much work the last fault tore down
        self._unheard: set[Hashable] = set()  # of it, the work whose end is yet to be judged

    def judge(self, work: Hashable, pid: int, running: Mapping[int, Hashable], alone: bool) -> Fault:
        """What the failure of ``work`` (its process ``pid``) means; ``running``: the other work on this server now,
        by process; ``alone``: it ran alone on the server (a suspect's second run)."""
        if torn := self._torn_down():  # a new fault: the work it tore down, this one and what still runs
            processes = {**running, pid: work}
            owners = {processes[client] if client in processes else self.whose(client) for client in torn}
            self._unheard = {owner for owner in owners if owner is not None and owner in processes.values()}
            self._size = len(self._unheard)
        if work not in self._unheard:
            return Fault.NONE
        self._unheard.discard(work)
        return Fault.OWN if alone or self._size == 1 else Fault.SUSPECT

    def _torn_down(self) -> set[int]:
        """The clients the server tore down since the log was last read (whole lines only)."""
        try:
            text = read_log(self.daemon.log_file, start=self._read)
        except OSError:
            return set()
        whole = text[: text.rfind(b"\n") + 1]
        self._read += len(whole)
        return set(torn_down_clients(whole.decode(errors="replace")))
