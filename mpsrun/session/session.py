"""``mps_session()``: a private MPS control daemon per GPU for the duration of a ``with`` block.

The same :class:`Session` is the one daemon life cycle of every path: the ``mpsrun``
launcher and node keepers start one too. Starting makes the private directory, writes
the typed record, starts the reaper, then the daemons; closing stops the daemons, tells
the reaper, and removes the directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.errors import ConfigError, DaemonError, MPSError, MPSUnavailableError, NoDriverError, TeardownError
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import ControlDaemon, unavailable_reason
from mpsrun.mps.environment import MANAGED_VARIABLES, GpuTarget, worker_variables
from mpsrun.mps.gpus import GPU
from mpsrun.mps.limits import DaemonDefaults
from mpsrun.mps.placement import NodePlan
from mpsrun.runtime.constants import DAEMON_START_TIMEOUT, DAEMON_STOP_TIMEOUT
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.claim import SessionClaim
from mpsrun.session.daemonset import DaemonSet
from mpsrun.session.export import Export
from mpsrun.session.paths import SessionDirs, session_base
from mpsrun.session.record import DaemonRecord

if TYPE_CHECKING:
    from mpsrun.mps.watch import ClientWatcher

__all__ = ["Session", "mps_session"]

log = logging.getLogger("mpsrun")


#: Variables a session may set in a worker's environment (restored on close when exported).
SESSION_VARIABLES = ("CUDA_VISIBLE_DEVICES", *MANAGED_VARIABLES)


class Session:
    """A running (or ready to run) set of private MPS daemons, one per GPU.

    Make one with :func:`mps_session`; use it as a context manager, or call :meth:`start` and :meth:`close`
    yourself. Arguments are checked when it is made, before anything starts.

    Args:
        gpu: one GPU, by index among the visible GPUs or by UUID (default 0).
        gpus: several GPUs (a list, ``"0,1"`` or ``"all"``); one daemon each.
        thread_percentage: cap on each client's share of SMs (1-100).
        mem_limit: pinned device memory per client, e.g. ``"4G"``, or ``"auto"``: each GPU's
            free memory split among ``workers`` (spread evenly over the GPUs).
        priority: client priority, 0 (normal) or 1 (below normal).
        tmpdir: where session directories go (default ``$MPSRUN_TMPDIR``,
            ``$XDG_RUNTIME_DIR`` or ``/tmp``).
        mps: ``"auto"`` runs without MPS (and says why) when there is no driver or control daemon (GPUs
            named are then ignored, with a word); ``"on"`` raises instead; ``"off"`` never starts MPS.
        keep_logs: keep the session directory (with the daemon logs) after exit.
        export: set the workers' variables in ``os.environ`` during the session so
            ``multiprocessing`` and ``subprocess`` children inherit them (default: yes
            with one GPU; several GPUs need ``session.env(rank)`` per worker).
        start_timeout, stop_timeout: deadlines in seconds for each daemon.
        gpu_bind: ``"single"`` (default): a worker sees one GPU, its daemon's; ``"none"``: one
            daemon serves every GPU of the session and every worker sees them all (for codes
            that choose their own device).
        workers: how many workers will use the session (for ``mem_limit="auto"``).
    """

    def __init__(
        self,
        gpu: int | str | None = None,
        gpus: Sequence[int | str] | str | None = None,
        thread_percentage: int | None = None,
        mem_limit: str | int | None = None,
        priority: int | None = None,
        tmpdir: str | os.PathLike[str] | None = None,
        mps: str = "auto",
        keep_logs: bool = False,
        export: bool | None = None,
        start_timeout: float = DAEMON_START_TIMEOUT,
        stop_timeout: float = DAEMON_STOP_TIMEOUT,
        gpu_bind: str = "single",
        workers: int | None = None,
        claim: SessionClaim | None = None,
    ) -> None:
        self._requested = values.parse_gpu_arguments(gpu, gpus)
        self._named = self._requested is not None and (gpu is not None or gpus is not None)  # not the default
        self.mps = values.parse_choice(mps, values.MPS_MODES, "mps")
        self.thread_percentage = None if thread_percentage is None else \
            values.parse_thread_percentage(thread_percentage)
        self.mem_limit = None if mem_limit is None else values.parse_mem_limit(mem_limit)
        self.priority = None if priority is None else values.parse_priority(priority)
        self.gpu_bind = values.parse_choice(gpu_bind, values.GPU_BINDS, "gpu_bind")
        self.workers = None if workers is None else values.parse_count(workers, "workers")
        if self.mem_limit == values.AUTO and self.workers is None:
            raise ConfigError("mem_limit='auto' needs workers=N: how many workers will share the session's GPUs",
                              setting="workers")
        self.base = session_base(tmpdir)
        self.start_timeout = values.parse_seconds(start_timeout, "start_timeout")
        self.stop_timeout = values.parse_seconds(stop_timeout, "stop_timeout")
        self.keep_logs = values.parse_flag(keep_logs, "keep_logs")
        self.export = None if export is None else values.parse_flag(export, "export")
        self.gpus: list[GPU] = []
        self._daemons = DaemonSet([], shared=False)
        self._claim = claim  # a node agent's (made before the session starts: it holds the agent's socket); or ours
        self._own_claim = claim is None  # an API session's: its words, its export, a directory only under MPS
        self.enabled = False
        self.disabled_reason: str | None = None
        self.teardown_errors: list[BaseException] = []
        self._exported: Export | None = None
        self._defaults = DaemonDefaults()  # the daemons', once the GPUs are known
        self._depth = 0  # nested `with` blocks on this session
        self._owner_pid: int | None = None
        # Ranks the record could not take were warned of: said once (a farm's tasks come and go).
        self._unrecorded_said = False
        self._state = "new"

    # -- starting -------------------------------------------------------------------------

    def resolve(self) -> Session:
        """Find the session's GPUs and decide whether MPS will run; starts nothing (:meth:`start` does this first:
        call it earlier to plan ranks on ``gpus``). Raises for an unknown GPU, or when ``mps="on"`` and MPS cannot
        run here."""
        if self._state != "new":
            return self
        try:
            self.gpus = gpu_info.select_gpus(self._requested, gpu_info.visible_gpus())
        except NoDriverError as exc:
            self.disabled_reason = exc.message
        if self.mps == "off" or self.disabled_reason is None:
            self.disabled_reason = unavailable_reason(self.mps)
        if self.disabled_reason is not None and self.mps == "on":
            raise MPSUnavailableError(f"MPS is required (mps='on') but unavailable: {self.disabled_reason}",
                                      reason=self.disabled_reason)
        self._daemons = DaemonSet(self.gpus, shared=self.gpu_bind == "none")
        if self.export is True and not self._daemons.one_view:
            raise ConfigError("export=True needs a single GPU: a process can reach only one MPS daemon; with several "
                              "GPUs give each worker session.env(rank), or use gpu_bind='none'",
                              setting="export", value=True)
        self._state = "resolved"
        return self

    def free_memory(self) -> list[int]:
        """Each GPU's free memory in bytes when the session looked (empty without MPS: no limit applies)."""
        return [g.memory_free for g in self.gpus] if self.disabled_reason is None else []

    def _planned(self) -> DaemonDefaults:
        """The daemons' defaults by the plan of the session's workers (worker ``r`` on GPU ``r % len(gpus)``), as a
        job's ranks are planned: ``auto`` splits each GPU's free memory among its workers."""
        config = JobConfig(thread_percentage=self.thread_percentage, mem_limit=self.mem_limit, priority=self.priority,
                           gpu_bind=self.gpu_bind, map_by="round-robin")
        return NodePlan.make(config, len(self.gpus), self.workers, self.free_memory()).daemon_defaults()

    @property
    def dirs(self) -> SessionDirs | None:
        """The session's directories, once it has them."""
        return self._claim.dirs if self._claim is not None else None

    def start(self, wait_active: bool = True) -> Session:
        """Start the daemons and wait until each GPU's server is ACTIVE.

        ``wait_active=False`` returns once every daemon answers and has its settings, with the servers still
        starting (clients that connect meanwhile are queued by the daemon); call :meth:`wait_active` before
        relying on them.
        """
        return self._start("active" if wait_active else "requested", None, None)

    def start_lazy(self, defaults: DaemonDefaults, meanwhile: Callable[[], object] | None = None) -> Session:
        """Start a node agent's session in the claim it was made with, with ``defaults`` as the ranks' plans decide
        them. Servers start with their first client, as a hand-started daemon's do; ``meanwhile`` runs while the
        daemons come up."""
        return self._start("lazy", defaults, meanwhile)

    def _start(self, server: str, defaults: DaemonDefaults | None, meanwhile: Callable[[], object] | None) -> Session:
        own = self._own_claim
        self.resolve()
        if self._state != "resolved":
            raise MPSError(f"this session is {self._state}; make a new one with mps_session()")
        self._state = "starting"
        self._owner_pid = os.getpid()
        self._defaults = self._planned() if defaults is None else defaults
        try:
            if self._claim is None and self.disabled_reason is None:
                self._claim = SessionClaim.make(self.base, "api", keep_logs=self.keep_logs)
            if self._claim is not None:
                self._claim.add_gpus([g.uuid for g in self.gpus], [group[0].index for group in self._daemons.groups()])
            if self.disabled_reason is None:
                self._start_daemons(server, meanwhile)
                self.enabled = True
            elif own:
                ignored = self._named and not self.gpus  # no driver: the GPUs named could not even be looked for
                log.warning("mpsrun: running without MPS: %s%s", self.disabled_reason,
                            f"; GPU {', '.join(map(str, self._requested or ()))} ignored" if ignored else "")
            if own and self.export is not False and self._daemons.one_view:
                self._export(self.env())
        except BaseException:
            self._state = "failed"
            with contextlib.suppress(Exception):
                self._teardown()
            raise
        self._state = "running"
        return self

    def _start_daemons(self, server: str, meanwhile: Callable[[], object] | None) -> None:
        assert self.dirs is not None

        def started(daemon: ControlDaemon) -> None:
            assert self._claim is not None
            self._claim.update(self._claim.record.with_daemon(DaemonRecord.of(daemon)))

        self._daemons.start(self.dirs, self._defaults, self.start_timeout, server, started, meanwhile)

    @property
    def daemons(self) -> list[ControlDaemon]:
        """The session's control daemons (one per GPU, or one for all under gpu_bind='none')."""
        return self._daemons.daemons

    def daemon(self, position: int) -> ControlDaemon | None:
        """The daemon serving the session's GPU at ``position`` (None without MPS)."""
        return self._daemons.of(position) if self._daemons.daemons else None

    def watcher(self) -> ClientWatcher:
        """The client watcher over every GPU of the session and the daemon that serves it."""
        return self._daemons.watcher()

    def add_ranks(self, ranks: Sequence[ProcessRef], replacing: bool = False) -> None:
        """Record local ranks' process groups, so a reaper can end them if we die (a record that cannot be written
        only costs that: the job goes on, and says so). ``replacing``: these are all there are now (a farm's running
        tasks)."""
        if self._claim is not None and self._state == "running" and (ranks or replacing):
            try:
                self._claim.update(self._claim.record.with_ranks(ranks, replacing))
            except MPSError as exc:
                if not self._unrecorded_said:
                    self._unrecorded_said = True
                    log.warning("mpsrun: warning: %s; should mpsrun be killed, its ranks' processes may outlive it",
                                exc)

    def add_launcher(self, pid: int) -> None:
        """Record the job's MPI launcher (its process group), for the reaper to end with the session."""
        if self._claim is not None:
            self._claim.add_launcher(pid)

    @property
    def state(self) -> str:
        """new, resolved, starting, running, failed or closed."""
        return self._state

    def wait_active(self) -> None:
        """Wait (with ``start_timeout``) until every server of the session is ACTIVE."""
        self._daemons.wait_active(self.start_timeout)

    def _export(self, env: Mapping[str, str]) -> None:
        self._exported = Export(SESSION_VARIABLES, env, drop_others=self.enabled)  # no stale MPS setting leaks

    # -- using ----------------------------------------------------------------------------

    def target(self, position: int) -> GpuTarget:
        """How a worker reaches the session's GPU at ``position`` (every GPU, under gpu_bind='none'):
        its UUID(s) and, under MPS, its daemon."""
        return self._daemons.target(position, str(self.dirs.root) if self.enabled and self.dirs else None)

    def _in_use(self) -> None:
        """Refuse to hand out a session that is not running (its paths would not exist)."""
        if self._state in ("new", "resolved", "closed", "failed"):
            state = "not started" if self._state in ("new", "resolved") else self._state
            raise MPSError(f"this session is {state}; use it inside `with` (or after start())")

    def env(self, rank: int | None = None) -> dict[str, str]:
        """Variables a worker needs to use this session (GPU ``rank % len(gpus)``, or all under gpu_bind='none')."""
        self._in_use()
        if not self.gpus:
            return {}
        position = self._daemons.position(rank)
        mem_limits = self._defaults.mem_limits
        return worker_variables(self.target(position), self._defaults.thread_percentage,
                                mem_limits[position] if mem_limits else None, self.priority)

    def clients(self) -> set[int]:
        """PIDs connected as clients to any of this session's servers."""
        self._in_use()
        return self._daemons.clients()

    def detach_clients(self, pids: Iterable[int]) -> list[int]:
        """Ask our servers to end the work of those ``pids`` that are their clients.

        NVIDIA documents ``terminate_client`` as the safe way to stop a client with GPU work in flight (killing
        it outright is undefined behaviour for the others). Returns the PIDs detached.
        """
        return self._daemons.detach(pids)

    def verify(self, pids: Iterable[int] | None = None) -> list[int]:
        """Check that processes using our GPUs are clients of our MPS servers.

        ``pids`` defaults to every descendant of this process. A process holding a CUDA context on one of the
        session's GPUs without being a client of our server ran into CUDA's silent fallback:
        :class:`NotMPSClientError` names it. Processes with no context yet are not judged; when none has one,
        nothing can be verified: :class:`NotMPSClientError` too. Returns the PIDs verified as clients.
        """
        if not self.enabled:
            return []
        if pids is None:
            import psutil  # not imported on every job's path

            pids = [child.pid for child in psutil.Process().children(recursive=True)]
        return self.watcher().verify(pids)

    def status(self) -> dict[str, Any]:
        """A snapshot: directories, and per GPU the daemon, its servers and clients."""
        report: dict[str, Any] = {
            "enabled": self.enabled,
            "state": self.state,
            "reason": self.disabled_reason,
            "directory": str(self.dirs.root) if self.dirs else None,
            "gpus": [_gpu_status(gpu, daemon) for gpu, daemon in self._daemons.started()],
        }
        return report

    # -- stopping -------------------------------------------------------------------------

    def _teardown(self) -> list[BaseException]:
        """Stop the daemons and restore the environment; an API session's own claim is released here at once (an
        agent's, which its ranks may still reach, at :meth:`close`)."""
        if self._exported is not None:
            self._exported.restore()
            self._exported = None
        errors = self._daemons.stop(self.stop_timeout)
        if self._own_claim:
            errors += self._release()
        return errors

    def _release(self) -> list[BaseException]:
        """The one place a session's claim is released: its directory removed (kept, with the daemons' logs, under
        keep_logs once daemons ran) and its reaper told."""
        if self._claim is None:
            return []
        return self._claim.release(self.keep_logs and bool(self._daemons.daemons))

    def begin_close(self) -> None:
        """Every worker has ended: begin stopping the daemons in the background; :meth:`close` finishes."""
        if self._state == "running" and self._owner_pid == os.getpid():
            self._daemons.stop_soon(self.stop_timeout)

    def close(self) -> None:
        """Stop the daemons and servers, restore the environment, remove the directories; raise
        :class:`TeardownError` if something could not be (nothing in a forked child, or when called again)."""
        if self._state == "closed" or (self._owner_pid is not None and self._owner_pid != os.getpid()):
            return
        started, self._state = self._state in ("starting", "running"), "closed"  # (a failed start tore down)
        self.teardown_errors = self._teardown() if started else []
        if not self._own_claim or not started:  # an agent's claim, or one never used: released now
            self.teardown_errors += self._release()
        if self.teardown_errors:
            raise TeardownError("session teardown failed: " + "; ".join(str(e) for e in self.teardown_errors),
                                errors=self.teardown_errors)

    def __enter__(self) -> Session:
        if self._state in ("new", "resolved"):
            self.start()
        elif self._state != "running":
            raise MPSError(f"this session is {self._state}; make a new one with mps_session()")
        self._depth += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._depth -= 1
        if self._depth > 0:  # an inner `with` of the same session: the outer one closes it
            return
        try:
            self.close()
        except TeardownError as teardown:
            if exc is None:
                raise
            # Never hide the body's exception: attach the teardown failure to it.
            if hasattr(exc, "add_note"):
                exc.add_note(f"mpsrun: {teardown}")
            else:  # pragma: no cover - Python 3.10
                log.error("mpsrun: %s", teardown)

    def __repr__(self) -> str:
        gpus = ",".join(str(g.index) for g in self.gpus) or "?"
        return f"<mpsrun.Session {self._state} gpus={gpus} mps={'on' if self.enabled else 'off'}>"


def _gpu_status(gpu: GPU, daemon: ControlDaemon) -> dict[str, Any]:
    """One GPU of a session's status: its daemon, the daemon's servers and their clients."""
    entry: dict[str, Any] = {"index": gpu.index, "uuid": gpu.uuid, "daemon_pid": daemon.pid,
                             "daemon_alive": daemon.alive, "servers": {}, "clients": {}}
    if daemon.alive:
        with contextlib.suppress(DaemonError):
            for server in daemon.server_list():
                entry["servers"][server] = daemon.server_status(server).value
                entry["clients"][server] = daemon.client_list(server)
    return entry


def mps_session(*args: Any, **kwargs: Any) -> Session:
    """A private MPS session: one control daemon per GPU, started on ``with``; takes the arguments of
    :class:`Session`. Example::

        with mps_session(gpu=0) as session:
            with multiprocessing.get_context("spawn").Pool(4) as pool:
                pool.map(work, range(4))
            session.verify()
    """
    return Session(*args, **kwargs)


# help() and inspect.signature() show Session's arguments, without importing inspect on the launch path.
mps_session.__wrapped__ = Session  # type: ignore[attr-defined]
