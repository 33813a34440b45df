"""The one client watcher: are the processes using our GPUs clients of our MPS servers?

Two proofs. A connection is proven by the daemon's own log: the server writes a line for
every client it accepts (:func:`mpsrun.mps.replies.connected_clients`), so a rank is proven
however briefly it lived. The silent fallback is found by sampling: CUDA silently runs
without MPS when a process cannot reach the daemon, and such a process shows in NVML as a
plain context (type C), never as an MPS client (M+C). NVML is read before the client list,
so a process NVML shows as connected is listed by then. ``Session.verify`` looks once; the
launcher and node keepers look repeatedly through :class:`RankWatch`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from mpsrun.errors import DaemonError, GPUError, NotMPSClientError
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.gpus import GPU
from mpsrun.mps.replies import ServerStatus, connected_clients, started_servers
from mpsrun.runtime.constants import WATCH_COMMAND_TIMEOUT
from mpsrun.runtime.files import read_log
from mpsrun.runtime.output import LINE_MOST, clipped

__all__ = ["ClientWatcher", "ConnectionLog", "Finding", "LogNews", "Look", "RankWatch", "with_descendants"]

log = logging.getLogger("mpsrun")


class Look(NamedTuple):
    """One look at every GPU: who is a client, who holds a plain context (by GPU position), dead daemons."""

    clients: frozenset[int]
    strays: tuple[tuple[int, int], ...]
    dead: tuple[int, ...]


class ClientWatcher:
    def __init__(self, gpus: Sequence[GPU], daemons: Sequence[ControlDaemon]) -> None:
        self.gpus = list(gpus)
        self.daemons = list(daemons)

    def look(self, pids: Iterable[int], served: set[int] | None = None) -> Look:
        """Who of ``pids`` is a client, and who holds a plain context on a GPU. ``served``: the clients known
        already (from the daemons' logs); without it each daemon is asked for its client list."""
        wanted = set(pids)
        clients: set[int] = set()
        strays: list[tuple[int, int]] = []
        dead: list[int] = []
        for position, (gpu, daemon) in enumerate(zip(self.gpus, self.daemons, strict=True)):
            if not daemon.alive:
                dead.append(position)
                continue
            contexts = gpu_info.compute_processes(gpu.uuid)
            known = daemon.clients() if served is None else served
            plain = {pid for pid, is_mps in contexts.items() if not is_mps} - set(daemon.server_pids)
            clients |= wanted & known  # NVML's M+C does not say whose server: only ours count
            strays += [(pid, position) for pid in sorted((wanted & plain) - known)]
        return Look(frozenset(clients), tuple(strays), tuple(dead))

    def verify(self, pids: Iterable[int]) -> list[int]:
        """The pids that are clients; raise :class:`NotMPSClientError` for any that missed MPS, or when none of
        them holds a CUDA context on these GPUs (nothing verified would read as a pass)."""
        asked = sorted(set(pids))
        look = self.look(asked)
        if asked and not look.clients and not look.strays:
            raise NotMPSClientError(f"none of process(es) {asked} holds a CUDA context on this session's GPUs: there "
                                    "is nothing to verify (verify while they use the GPU)", pids=asked)
        if look.strays:
            position = look.strays[0][1]
            strays = [pid for pid, where in look.strays if where == position]
            gpu, daemon = self.gpus[position], self.daemons[position]
            raise NotMPSClientError(
                f"process(es) {strays} use GPU {gpu.index} ({gpu.uuid}) without MPS: they are not clients "
                f"of this session's server (check CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir})",
                pids=strays,
                gpu=gpu.uuid,
            )
        return sorted(look.clients)


class LogNews(NamedTuple):
    """What a daemon's log said since the last read: servers started, clients connected (pids, in order)."""

    servers: tuple[int, ...] = ()
    clients: tuple[int, ...] = ()


class ConnectionLog:
    """What a daemon's log says since the last read (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def news(self) -> LogNews:
        try:
            text = read_log(self.path, start=self._offset)
        except OSError:  # not written yet, or the session is gone
            return LogNews()
        whole = text[: text.rfind(b"\n") + 1]
        self._offset += len(whole)
        lines = whole.decode(errors="replace")
        return LogNews(tuple(started_servers(lines)), tuple(connected_clients(lines)))


class Finding(NamedTuple):
    """Something the watch (or a host's node keeper) saw; ``fatal`` ends the job, with ``code`` (default 3)."""

    message: str
    fatal: bool
    rank: int | None = None
    code: int | None = None


def with_descendants(pids: Mapping[int, int]) -> dict[int, int]:
    """``{pid: rank}`` for the ranks' processes and all their descendants (the same rank).

    One pass over the process table for all ranks (``Process.children`` would make one per rank, every look).
    """
    if not pids:
        return {}
    import psutil  # a job's first look comes after its start: not imported on every job's path

    children: dict[int, list[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process.pid)
    result, pending = dict(pids), list(pids)
    while pending:
        parent = pending.pop()
        for child in children.get(parent, ()):
            if child not in result:
                result[child] = result[parent]
                pending.append(child)
    return result


class RankWatch:
    """Repeated looks during a job: a rank is reported after two looks in a row see it off MPS.

    ``verified``: ranks proven MPS clients (by the daemons' logs or their client lists);
    ``without_mps``: ranks seen holding a plain context on a job GPU.
    """

    def __init__(self, watcher: ClientWatcher, required: bool) -> None:
        self.watcher = watcher
        self.required = required
        self.verified: set[int] = set()
        self.without_mps: set[int] = set()
        self._suspects: dict[int, int] = {}
        self._logs = [(daemon, ConnectionLog(daemon.log_file))
                      for daemon in {id(d): d for d in watcher.daemons}.values()]
        self._serving: set[int] = set()  # daemons (by id) whose server has had its first client
        self._known: dict[int, int] = {}  # every pid seen as a rank or a rank's descendant: {pid: rank}
        self._unplaced: set[int] = set()  # clients in a log not (yet) known as ours
        self._connected: set[int] = set()  # every client the logs named

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """NVML initialised once for the job's looks (each is then cheap); without NVML each look says so."""
        with gpu_info.nvml_kept():
            yield

    def owner(self, pid: int) -> int | None:
        """The rank a process seen so far belongs to (itself, or a descendant), or None."""
        return self._known.get(pid)

    def settle(self, rank_pids: Mapping[int, int]) -> None:
        """Read the logs once more, at the job's end: ``rank_pids`` are every rank's pids, ended ones too."""
        self._known.update(rank_pids)
        self._read_logs()

    def _read_logs(self) -> list[ControlDaemon]:
        """Take in what the logs say; the daemons whose server has just had its first client."""
        first: list[ControlDaemon] = []
        for daemon, connection_log in self._logs:
            news = connection_log.news()
            for server in news.servers:
                daemon.saw_server(server, from_log=True)
            self._unplaced.update(news.clients)
            if news.clients and id(daemon) not in self._serving:
                self._serving.add(id(daemon))
                first.append(daemon)
        self._connected |= self._unplaced
        placed = self._unplaced & self._known.keys()
        self.verified.update(self._known[pid] for pid in placed)
        self._unplaced -= placed
        return first

    def _server_fault(self, daemon: ControlDaemon) -> Finding | None:
        """A server started by its first client is checked then: is it ACTIVE, or in FAULT?"""
        try:
            faulty = [pid for pid in daemon.server_list(WATCH_COMMAND_TIMEOUT)
                      if daemon.server_status(pid, WATCH_COMMAND_TIMEOUT) is ServerStatus.FAULT]
        except DaemonError as exc:
            log.debug("server check skipped: %s", exc)
            return None
        if not faulty:
            return None
        gpus = ",".join(str(g.index) for g, d in zip(self.watcher.gpus, self.watcher.daemons, strict=True)
                        if d is daemon)
        return Finding(f"the MPS server {faulty[0]} of GPU {gpus} is in FAULT state (its log: {daemon.log_file})",
                       fatal=True)

    def check(self, rank_pids: Mapping[int, int]) -> list[Finding]:
        pids = with_descendants(rank_pids)
        self._known.update(pids)
        findings = [f for daemon in self._read_logs() if (f := self._server_fault(daemon)) is not None]
        if not pids:  # no rank runs yet: nothing to look for (nor NVML to initialise)
            return findings + self.dead_daemons()
        try:
            look = self.watcher.look(pids, served=self._connected)
        except (DaemonError, GPUError) as exc:
            log.debug("client check skipped: %s", exc)
            return findings
        findings += self._dead_findings(look.dead)
        self.verified.update(pids[pid] for pid in look.clients)
        missed = {pid: position for pid, position in look.strays}
        self._suspects = {pid: self._suspects.get(pid, 0) + 1 for pid in missed}
        for pid, count in sorted(self._suspects.items()):
            rank = pids[pid]
            if count >= 2 and rank not in self.without_mps:
                self.without_mps.add(rank)
                findings.append(self._stray(rank, pid, missed[pid]))
        return findings

    def dead_daemons(self) -> list[Finding]:
        """A finding for each daemon of the session that has died (no command is sent)."""
        return self._dead_findings([p for p, daemon in enumerate(self.watcher.daemons) if not daemon.alive])

    def _dead_findings(self, positions: Iterable[int]) -> list[Finding]:
        """One finding per dead daemon (one daemon may serve several GPUs), naming the GPUs it served."""
        served: dict[int, list[int]] = {}
        for position in positions:
            served.setdefault(id(self.watcher.daemons[position]), []).append(position)
        return [self._dead(group) for group in served.values()]

    def _dead(self, positions: list[int]) -> Finding:
        daemon = self.watcher.daemons[positions[0]]
        tail = daemon.log_tail(5)
        last = f"; its log ends: {clipped(tail.splitlines()[-1], LINE_MOST)}" if tail else ""  # (a rank can write it)
        gpus = ",".join(str(self.watcher.gpus[p].index) for p in positions)
        return Finding(f"the MPS control daemon of GPU {gpus} died under the job{last}", fatal=True)

    def _stray(self, rank: int, pid: int, position: int) -> Finding:
        message = (
            f"rank {rank} (pid {pid}) uses GPU {position} without MPS: not a client of this job's MPS server "
            "(CUDA silently runs without MPS when it cannot reach the daemon; does the rank change "
            "CUDA_MPS_PIPE_DIRECTORY?)"
        )
        return Finding(message, fatal=self.required, rank=rank)
