"""A session's set of daemons: which daemon serves which GPU, how a worker reaches it, and the clients they serve.

One daemon per GPU by default; under ``gpu_bind="none"`` one daemon serves every GPU of the
session (its ``CUDA_VISIBLE_DEVICES`` lists them all) and every worker sees them all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from mpsrun.errors import ConfigError, DaemonError
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.environment import GpuTarget
from mpsrun.mps.gpus import GPU
from mpsrun.mps.limits import DaemonDefaults
from mpsrun.runtime.constants import DETACH_TIMEOUT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import uninterrupted
from mpsrun.session.paths import SessionDirs

if TYPE_CHECKING:
    from mpsrun.mps.watch import ClientWatcher

__all__ = ["DaemonSet"]

log = logging.getLogger("mpsrun")


class DaemonSet:
    """The daemons serving ``gpus``: one each, or one for all of them (``shared``)."""

    def __init__(self, gpus: Sequence[GPU], shared: bool) -> None:
        self.gpus = list(gpus)
        self.shared = shared and len(self.gpus) > 1
        self.daemons: list[ControlDaemon] = []
        self._stopper: threading.Thread | None = None  # stop_soon()'s
        self._stop_errors: list[BaseException] = []

    @property
    def one_view(self) -> bool:
        """Every worker gets the same variables: one GPU, or one daemon for all of them."""
        return len(self.gpus) <= 1 or self.shared

    def position(self, rank: int | None) -> int:
        """The GPU position of worker ``rank`` (``rank % len(gpus)``; 0 when every worker sees the same)."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"rank must be a non-negative integer, not {rank!r}", setting="rank", value=rank)
        if self.one_view:
            return 0
        if rank is None:
            raise ConfigError("this session has several GPUs: pass rank= to env() to choose one", setting="rank")
        return rank % len(self.gpus)

    def groups(self) -> list[list[GPU]]:
        """The GPUs each daemon serves, in order."""
        return [list(self.gpus)] if self.shared else [[gpu] for gpu in self.gpus]

    def start(self, dirs: SessionDirs, defaults: DaemonDefaults, timeout: float, server: str,
              started: Callable[[ControlDaemon], None], meanwhile: Callable[[], object] | None = None) -> None:
        """Start each daemon with its default limits; ``started`` hears of each at once.

        The daemons come up together, and ``meanwhile`` runs while they do.
        ``server``: ``active`` starts each server and waits until it is ACTIVE; ``requested`` asks for it
        and returns; ``lazy`` leaves it to the first client (or to a later :meth:`ControlDaemon.start_server`),
        as a hand-started daemon does.
        """
        main_thread = threading.current_thread() is threading.main_thread()
        for group in self.groups():
            first = group[0].index
            daemon = ControlDaemon(",".join(g.uuid for g in group), dirs.pipe_dir(first), dirs.log_dir(first))
            self.daemons.append(daemon)
            with uninterrupted():  # a signal waits until the daemon is on record, for the teardown to end it
                daemon.spawn(parent_death=main_thread)  # the reaper covers other threads
                started(daemon)  # recorded before anything else can fail
        if meanwhile is not None:
            meanwhile()
        for position, daemon in enumerate(self.daemons):
            daemon.await_answer(timeout)
            mem_limits = defaults.mem_limits
            daemon.set_defaults(defaults.thread_percentage, mem_limits[position] if mem_limits else None)
            if server != "lazy":
                daemon.start_server(timeout=timeout, wait=server == "active")

    def of(self, position: int) -> ControlDaemon:
        """The daemon serving the GPU at ``position``."""
        return self.daemons[0 if self.shared else position]

    def started(self) -> list[tuple[GPU, ControlDaemon]]:
        """Each GPU whose daemon has been started, with that daemon (a failed start leaves some without)."""
        count = len(self.gpus) if self.shared and self.daemons else len(self.daemons)
        return [(self.gpus[p], self.of(p)) for p in range(count)]

    def watcher(self) -> ClientWatcher:
        """The client watcher over every GPU and the daemon that serves it."""
        from mpsrun.mps.watch import ClientWatcher  # with the controller, while the daemons start

        return ClientWatcher(self.gpus, [self.of(p) for p in range(len(self.gpus))])

    def target(self, position: int, session_dir: str | None) -> GpuTarget:
        """How a worker reaches the GPU at ``position`` (every GPU, when shared): its UUID(s) and, under MPS
        (a ``session_dir``), its daemon."""
        group = self.gpus if self.shared else [self.gpus[position]]
        visible = ",".join(g.uuid for g in group)
        counts = [g.multiprocessors for g in group if g.multiprocessors]
        multiprocessors = min(counts) if len(counts) == len(group) else None
        if session_dir is None:
            return GpuTarget(visible, devices=len(group), multiprocessors=multiprocessors)
        daemon = self.of(position)
        return GpuTarget(visible, str(daemon.pipe_dir), str(daemon.log_dir), session_dir, len(group), multiprocessors)

    def wait_active(self, timeout: float) -> None:
        for daemon in self.daemons:
            daemon.wait_active(timeout=timeout)

    def clients(self) -> set[int]:
        """PIDs connected as clients to any of the servers."""
        result: set[int] = set()
        for daemon in self.daemons:
            result |= daemon.clients()
        return result

    def detach(self, pids: Iterable[int]) -> list[int]:
        """``terminate_client`` for those ``pids`` that are clients; the PIDs detached. A courtesy before the ranks
        are signalled, so bounded: each command by DETACH_TIMEOUT, and none is sent once that much time has gone."""
        wanted = set(pids)
        detached: list[int] = []
        deadline = Deadline(DETACH_TIMEOUT)
        for daemon in (d for d in self.daemons if d.alive):
            for server in daemon.server_list(DETACH_TIMEOUT):
                for client in sorted(wanted & set(daemon.client_list(server, DETACH_TIMEOUT))):
                    if deadline.expired():  # the signals that follow end the rest
                        return detached
                    with contextlib.suppress(DaemonError):  # it may have exited meanwhile
                        daemon.terminate_client(server, client, DETACH_TIMEOUT)
                        detached.append(client)
        return detached

    def stop_soon(self, timeout: float) -> None:
        """Begin :meth:`stop` in a thread, for a caller with other waiting to do (every client has ended)."""
        if self._stopper is None and self.daemons:
            self._stopper = threading.Thread(target=lambda: self._stop_errors.extend(self._stop_each(timeout)),
                                             name="mpsrun-teardown", daemon=True)
            self._stopper.start()

    def stop(self, timeout: float) -> list[BaseException]:
        """Stop every daemon, or wait for :meth:`stop_soon`'s; what failed."""
        if self._stopper is None:
            return self._stop_each(timeout)
        self._stopper.join()
        return self._stop_errors

    def _stop_each(self, timeout: float) -> list[BaseException]:
        """Stop every daemon at once: each may wait out its own quit (one after another, two hanging quits took twice
        as long). One line names those that quit did not end."""
        results: dict[int, str | BaseException | None] = {}

        def stop(daemon: ControlDaemon) -> None:
            try:
                results[id(daemon)] = daemon.stop(timeout=timeout)
            except Exception as exc:  # keep stopping the others
                results[id(daemon)] = exc

        helpers = [threading.Thread(target=stop, args=(daemon,), name="mpsrun-stop", daemon=True)
                   for daemon in self.daemons[1:]]
        for helper in helpers:
            helper.start()
        if self.daemons:
            stop(self.daemons[0])
        for helper in helpers:
            helper.join()
        forced: dict[str, list[str]] = {}  # the daemons ended by signal, by why
        for daemon in self.daemons:
            if isinstance(why := results.get(id(daemon)), str):
                forced.setdefault(why, []).append(str(daemon.pid))
        for why, pids in forced.items():
            log.warning("mpsrun: MPS control daemon%s %s %s; terminated", "s" * (len(pids) > 1), ", ".join(pids), why)
        return [result for result in results.values() if isinstance(result, BaseException)]
