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


#: A fault's block in a server's log (recorded on an H100): it begins ``Server is handling a fatal GPU error.``,
#: names each client ``... on device N to be torn down``, and is whole at ``... have a sticky error set:``.
_BEGINS, _WHOLE = "is handling a fatal GPU error", "have a sticky error set"


class ServerFaults:
    """The fatal faults of ``daemon``'s server, read from its log as the work it serves fails. ``whose``: the work a
    client process belongs to, where it is not the work's own process (a child of it), else None."""

    def __init__(self, daemon: ControlDaemon, whose: Callable[[int], Hashable | None]) -> None:
        self.daemon, self.whose = daemon, whose
        self._read = 0  # how far the log was read
        self.torn: set[int] = set()  # the clients the last fault tore down (their CUDA contexts are broken)
        self._whole = True  # the last fault's block has been read to its end
        self._victims: set[Hashable] = set()  # the work it tore down
        self._judged: set[Hashable] = set()  # of that, the work whose end was judged

    def judge(self, work: Hashable, pid: int, running: Mapping[int, Hashable], alone: bool) -> Fault:
        """What the failure of ``work`` (its process ``pid``) means; ``running``: the other work on this server now,
        by process; ``alone``: it ran alone on the server (a suspect's second run). Work the fault tore down is the
        fault's own when it ran alone, or when the fault's whole block names no other work; else a suspect."""
        processes = {**running, pid: work}
        for client in self._read_faults():
            owner = processes[client] if client in processes else self.whose(client)  # a client may be a child
            if owner is not None and owner in processes.values():
                self._victims.add(owner)
        if work not in self._victims or work in self._judged:
            return Fault.NONE
        self._judged.add(work)
        return Fault.OWN if alone or (self._whole and self._victims == {work}) else Fault.SUSPECT

    def _read_faults(self) -> list[int]:
        """The clients torn down that the log says since it was last read (whole lines only); a new fault's block
        starts the count anew."""
        try:
            text = read_log(self.daemon.log_file, start=self._read)
        except OSError:
            return []
        whole = text[: text.rfind(b"\n") + 1]
        self._read += len(whole)
        clients: list[int] = []
        for line in whole.decode(errors="replace").splitlines():
            if _BEGINS in line:
                self.torn, self._victims, self._judged, self._whole, clients = set(), set(), set(), False, []
            elif _WHOLE in line:
                self._whole = True
            elif found := torn_down_clients(line):
                self.torn.update(found)
                clients += found
        return clients
