"""``mpsrun.Executor``: a :class:`concurrent.futures.Executor` whose worker processes share the GPUs through MPS.

The workers are placed on the GPUs as a job's ranks are (the same plan: :class:`~mpsrun.mps.placement.NodePlan`),
each with its GPU, SM share and memory limit, and each a client of a private MPS daemon per GPU that lives as long as
the executor. They are spawned (CUDA cannot cross a fork) with their variables in their environment from the start,
and they stay: a worker keeps its CUDA context and compiled kernels from one call to the next, which is where most of
a small task's time goes. Functions, arguments and results travel pickled, as :class:`ProcessPoolExecutor`'s do.

A call's exception reaches its future with the worker's traceback as its ``__cause__``. A worker that dies fails only
the future it was running (:class:`WorkerDiedError` names the worker, its GPU and how it died), and a fresh worker
takes its place. Without a GPU or MPS (``mps="auto"``) the workers are plain processes, and that is said once.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor as _Executor
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from mpsrun.agent.findings import crowding_warnings
from mpsrun.config import values
from mpsrun.config.options import JobConfig
from mpsrun.errors import MPSError, WorkerDiedError
from mpsrun.exitcodes import describe_returncode
from mpsrun.farm.farm import slots_of
from mpsrun.farm.faults import Fault, ServerFaults
from mpsrun.farm.worker import RemoteTraceback, serve
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.environment import MANAGED_VARIABLES
from mpsrun.mps.placement import NodePlan, ranks_on_gpus
from mpsrun.mps.usage import UsageSampler
from mpsrun.mps.watch import RankWatch, with_descendants
from mpsrun.runtime.constants import USAGE_INTERVAL
from mpsrun.runtime.processes import close_all, descendants, end_processes, ensure_descriptors, pidfd
from mpsrun.session.session import Session

log = logging.getLogger("mpsrun")

__all__ = ["Executor", "WorkerAccount"]


class WorkerAccount(NamedTuple):
    """One worker slot's account: the calls it ran (``failed`` of them raised or died), how many processes it took
    (a dead worker's place is taken by a fresh one), its GPU, whether its processes were MPS clients (None: no
    context seen, or no MPS), their seconds alive and of CPU, and their peak device memory (MiB; None: none seen)."""

    worker: int
    gpu: int | None
    calls: int
    failed: int
    processes: int
    mps: bool | None
    wall: float
    cpu: float | None
    memory_peak: int | None = None  # MiB of device memory, the most its processes held at one sample


class _Call(NamedTuple):
    """A submitted call: its number, its future, and what to run."""

    number: int
    future: Future[Any]
    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Worker:
    """One worker slot: its process now, its connection, the call it runs, and its account so far."""

    __slots__ = ("alone", "calls", "connection", "cpu", "daemon", "env", "exit_fd", "failed", "gpu", "index",
                 "process", "processes", "running", "started", "taken", "wall")

    def __init__(self, index: int, gpu: int | None, daemon: ControlDaemon | None, env: Mapping[str, str]) -> None:
        self.index, self.gpu, self.daemon, self.env = index, gpu, daemon, dict(env)
        self.process: Any = None
        self.connection: Connection | None = None
        self.exit_fd = -1  # a pidfd of its process: readable once it ends (its sentinel pipe may live on in a child)
        self.running: _Call | None = None
        self.taken = False  # the worker said it took the call it was sent (a death before that is not the call's)
        self.alone = False  # the call it runs must run alone on its server (a fault's suspect)
        self.started = 0.0
        self.calls = self.failed = self.processes = 0
        self.wall, self.cpu = 0.0, 0.0


class Executor(_Executor):
    """``workers`` processes placed on ``gpus`` (``"all"``, ``"0,1"``, a list) by ``map_by`` (``block`` or
    ``round-robin``), each with ``thread_percentage`` (P, ``auto`` or one per worker) and ``mem_limit`` (``4G``,
    ``auto``); ``mps``: ``auto`` (plain processes where MPS cannot run, said once), ``on`` (MPSError instead) or
    ``off``. Use it as a context manager, or call :meth:`shutdown`."""

    def __init__(self, workers: int = 1, *, gpus: object = "all", thread_percentage: object = None,
                 mem_limit: object = None, map_by: str = "block", mps: str = "auto") -> None:
        if multiprocessing.current_process().daemon:  # (multiprocessing says only "daemonic processes are not ...")
            raise RuntimeError("an mpsrun.Executor cannot start inside a worker of another: its workers are daemonic "
                               "processes, which cannot have children")
        count, shares = values.parse_ranks(workers, "workers"), values.parse_thread_spec(thread_percentage,
                                                                                           "thread_percentage")
        values.check_shares(shares, count, "thread_percentage", "worker")
        ensure_descriptors(count, _DESCRIPTORS_PER_WORKER, "worker(s)")
        config = JobConfig(command=("python",), nranks=count, gpus=values.parse_gpus(gpus, "gpus"),
                           thread_percentage=shares,
                           mem_limit=None if mem_limit is None else values.parse_mem_limit(mem_limit),
                           map_by=values.parse_choice(map_by, values.MAP_POLICIES, "map_by"),
                           mps=values.parse_choice(mps, values.MPS_MODES, "mps"))
        self._session = Session(gpus=list(config.gpus) if config.gpus is not None else "all", mps=config.mps,
                                export=False)
        self._workers = self._start_session(config)
        self._watch = RankWatch(self._session.watcher(), False) if self._session.enabled else None
        self._usage = UsageSampler([gpu.uuid for gpu in self._session.gpus]) if self._session.gpus else None
        self._context = multiprocessing.get_context("spawn")
        self._pending: collections.deque[_Call] = collections.deque()
        self._suspects: dict[int, collections.deque[_Call]] = {}  # by daemon (id): calls a fault tore down
        self._faults: dict[int, ServerFaults] = {}  # by daemon (id): its server's faults
        self._resent: set[int] = set()  # calls sent again: their first worker died before it took them
        self._numbers = itertools.count()
        self._lock = threading.Condition()
        self._shutdown = False
        self._broken: MPSError | None = None  # why the executor cannot go on, once it cannot
        # Wakes the manager: non-blocking, as a full pipe already holds a wake-up (a callback that submits runs in
        # the manager's own thread), and closed under its own lock (a closed descriptor's number may be reused).
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._started = threading.Event()
        self._start_failure: list[BaseException] = []  # (what the manager met as it started the workers)
        self._manager = threading.Thread(target=self._run, name="mpsrun-executor", daemon=True)
        self._sampling_ends = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="mpsrun-executor-usage", daemon=True)
        self._start_workers()

    def _start_workers(self) -> None:
        """Start the manager thread, and wait until it has started the workers. They are started (and replaced) by
        that thread alone: each dies with the thread that started it (its parent-death signal), so none outlives a
        killed executor, and none dies with a caller's short-lived thread."""
        self._manager.start()
        try:
            self._started.wait()
        except BaseException:  # (a Ctrl-C as the workers start: nothing is left running without a handle)
            self.shutdown(wait=True)
            raise
        if self._start_failure:
            self._manager.join()
            raise self._start_failure[0]
        # As concurrent.futures' own executors: the interpreter's exit waits for the calls submitted.
        self._at_exit = functools.partial(self.shutdown, wait=True)
        atexit.register(self._at_exit)

    def _start_session(self, config: JobConfig) -> list[_Worker]:
        """The session's daemons started with the plan's defaults; each worker's place and variables."""
        session = self._session
        session.resolve()
        plan = NodePlan.make(config, len(session.gpus), config.ranks, session.free_memory(), config.ranks)
        session.start_lazy(plan.daemon_defaults())
        if session.enabled:
            for line in crowding_warnings(ranks_on_gpus(plan.ranks(config.ranks)), "workers"):
                log.warning(f"mpsrun: {line}")
        return [_Worker(slot.index, slot.gpu, slot.daemon, slot.env)
                for slot in slots_of(session, plan.ranks(config.ranks), None)]

    # -- the workers --------------------------------------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        """Start ``worker``'s process; it puts its variables in its environment before its first call (CUDA reads
        them once, as it initialises: code at the top of the main module, which a spawned process imports first,
        must not use the GPU, as with any spawned pool)."""
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=serve, args=(theirs, worker.env, list(MANAGED_VARIABLES), os.getpid()),
                                        name=f"mpsrun-worker-{worker.index}", daemon=True)
        process.start()
        theirs.close()
        worker.process, worker.connection, worker.started = process, ours, time.monotonic()
        exit_fd = pidfd(process.pid) if process.pid is not None else None
        assert exit_fd is not None, "Linux 5.3 or later: pidfd_open"
        worker.exit_fd = exit_fd
        worker.processes += 1

    def _retire(self, worker: _Worker) -> None:
        """The worker's process has ended (not yet reaped): its time and CPU are counted, its connection closed."""
        worker.wall += time.monotonic() - worker.started
        worker.cpu += _cpu(worker.process.pid)
        if worker.connection is not None:
            worker.connection.close()
        worker.process.join()
        close_all([worker.exit_fd])

    # -- the manager thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The manager thread's life: it manages until shut down and idle, then ends the workers and the session
        (here, whoever shut down and however often: a future's callback that shuts down runs in this thread)."""
        try:
            try:
                for worker in self._workers:
                    self._spawn(worker)
                if self._usage is not None:  # (here: the caller's thread can take a Ctrl-C from start to the wait)
                    self._sampler.start()
            except BaseException as exc:  # (said by the constructor, once this thread has cleaned up)
                self._start_failure.append(exc)
                return
            finally:
                self._started.set()
            try:
                self._manage()
            except Exception as exc:  # (a worker that cannot be replaced: out of processes, memory, descriptors)
                self._break(exc)
        finally:
            self._finish()

    def _break(self, cause: Exception) -> None:
        """The executor cannot go on: every call not done fails with why, and no call is taken any more."""
        broken = MPSError(f"the mpsrun.Executor cannot go on: {cause}")
        with self._lock:
            self._shutdown, self._broken = True, broken
            calls = [*self._pending, *(c for s in self._suspects.values() for c in s),
                     *(w.running for w in self._workers if w.running is not None)]
            self._pending.clear()
            self._suspects.clear()
            for worker in self._workers:
                worker.running = None
        for call in calls:
            if not call.future.done():
                call.future.set_exception(broken)

    def _manage(self) -> None:
        """Hand out calls, take results, replace dead workers, until shut down and idle."""
        while True:
            with self._lock:
                self._dispatch()
                if self._shutdown and not self._pending and not any(self._suspects.values()) and \
                        all(w.running is None for w in self._workers):
                    self._lock.notify_all()
                    return
                waits: dict[Any, _Worker | None] = {self._wake_read: None}
                for worker in self._workers:
                    waits[worker.connection] = worker
                    waits[worker.exit_fd] = worker
            for ready in wait(list(waits)):
                if ready == self._wake_read:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_read, 1 << 16)
                    continue
                found = waits[ready]
                assert found is not None
                worker = found
                with self._lock:
                    if ready is worker.connection:
                        self._answer(worker)
                    elif ready == worker.exit_fd and not worker.process.is_alive():
                        self._died(worker)

    def _sample(self) -> None:
        """The usage thread: each USAGE_INTERVAL, the device memory of the workers that run a call (for their peaks).
        Apart from the manager, with NVML kept initialised: NVML's pace (its start and end can take long) never holds
        up a call's dispatch."""
        assert self._usage is not None
        with gpu_info.nvml_kept():
            while not self._sampling_ends.wait(USAGE_INTERVAL):
                with self._lock:
                    pids = {w.process.pid: w.index for w in self._workers
                            if w.running is not None and w.process is not None and w.process.is_alive()}
                if pids:
                    try:
                        self._usage.sample(with_descendants(pids))
                    except Exception as exc:  # (out of descriptors, say): no sample this time, and no traceback
                        log.debug("mpsrun: memory sample skipped: %s", exc)

    def _dispatch(self) -> None:
        """Give each idle worker its next call: a suspect of its server's fault once no other call runs there (it
        runs alone), else the next call submitted, unless its server is finding a fault's culprit."""
        for worker in self._workers:
            while worker.running is None and worker.process.is_alive():  # (a dead one is replaced first)
                suspects = self._suspects.get(id(worker.daemon))
                if suspects and self._busy(worker.daemon):
                    break
                alone = bool(suspects)  # (before the last suspect is taken from them)
                queue = suspects or (None if self._busy(worker.daemon, alone=True) else self._pending)
                if not queue:
                    break
                call = queue.popleft()
                if (call.future.running() or call.future.set_running_or_notify_cancel()) and \
                        not self._send(worker, call, alone):
                    queue.appendleft(call)  # the worker died idle: the call waits for the one in its place
                    break

    def _busy(self, daemon: ControlDaemon | None, alone: bool = False) -> bool:
        """Whether a call runs on ``daemon``'s server (``alone``: one that must run alone there)."""
        return daemon is not None and any(w.daemon is daemon and w.running is not None and (w.alone or not alone)
                                          for w in self._workers)

    def _send(self, worker: _Worker, call: _Call, alone: bool) -> bool:
        """Send ``call`` to ``worker``: False where the worker is gone (the call is not sent)."""
        assert worker.connection is not None
        worker.running, worker.alone, worker.taken = call, alone, False
        try:
            worker.connection.send((call.number, bytes(ForkingPickler.dumps((call.function, call.args, call.kwargs)))))
        except OSError:  # (a broken pipe: the worker died since it was found alive)
            worker.running = None
            return False
        except Exception as exc:  # the call cannot be pickled: its future says why
            worker.running = None
            call.future.set_exception(exc)
        return True

    def _answer(self, worker: _Worker) -> bool:
        """Take what the worker sent (that it took its call, or the call's outcome); False once it is gone."""
        assert worker.connection is not None
        try:
            outcome = worker.connection.recv()
        except (EOFError, OSError):
            return False  # the process is ending: its pidfd says so
        except Exception as exc:  # the outcome could not be unpickled here
            outcome = (worker.running.number if worker.running else -1, False, exc, "")
        call = worker.running
        if call is not None and outcome == call.number:
            worker.taken = True
            return True
        if call is None or not isinstance(outcome, tuple) or outcome[0] != call.number:
            return True
        worker.running = None
        if outcome[1]:
            worker.calls += 1
            call.future.set_result(outcome[2])
            return True
        raised = outcome[2]
        if outcome[3]:
            raised.__cause__ = RemoteTraceback(f'\n"""\n{outcome[3]}"""')
        self._failed(worker, call, raised)
        return True

    def _died(self, worker: _Worker) -> None:
        """A worker's process ended on its own: the call it ran fails, one it had not yet taken is sent again (once),
        and a fresh process takes its place."""
        assert worker.connection is not None
        while worker.connection.poll() and self._answer(worker):  # what it sent before it died comes first
            pass
        returncode = worker.process.exitcode
        self._retire(worker)
        call, worker.running = worker.running, None
        if call is not None and not worker.taken and call.number not in self._resent:
            self._resent.add(call.number)
            (self._suspects[id(worker.daemon)] if worker.alone else self._pending).appendleft(call)
        elif call is not None:
            where = f"GPU {worker.gpu}" if worker.gpu is not None else "no GPU"
            self._failed(worker, call, WorkerDiedError(
                f"worker {worker.index} ({where}, pid {worker.process.pid}) {describe_returncode(returncode)} while "
                "it ran this call; a fresh worker takes its place", worker=worker.index, gpu=worker.gpu,
                returncode=returncode), died=True)
        if not self._shutdown or self._pending or any(self._suspects.values()):  # (calls left to run)
            self._spawn(worker)

    def _failed(self, worker: _Worker, call: _Call, raised: BaseException, died: bool = False) -> None:
        """A call failed: a fatal fault's suspect runs again alone (its future waits), the fault's own call and any
        other fail with ``raised``. A worker the fault tore down is replaced (its CUDA context is broken for good)."""
        verdict, torn = Fault.NONE, set()
        if worker.daemon is not None and not self._shutdown:
            # A client that is not a worker is no call's (a call's children are its worker's, and fail with it).
            faults = self._faults.setdefault(id(worker.daemon), ServerFaults(worker.daemon, lambda pid: None))
            others = {w.process.pid: w.running.number for w in self._workers
                      if w is not worker and w.daemon is worker.daemon and w.running is not None}
            verdict = faults.judge(call.number, worker.process.pid, others, worker.alone)
            torn = faults.torn
        if verdict is Fault.SUSPECT:
            self._suspects.setdefault(id(worker.daemon), collections.deque()).append(call)
        else:
            worker.calls, worker.failed = worker.calls + 1, worker.failed + 1
            if verdict is Fault.OWN:
                _note(raised, f"this call caused a fatal GPU fault (it ran alone on worker {worker.index}'s MPS server)"
                      if worker.alone else "this call caused a fatal GPU fault (the only call it tore down)")
            call.future.set_exception(raised)
        for broken in [w for w in self._workers if not died or w is not worker]:
            if broken.process.pid in torn and broken.running is None and broken.process.is_alive():
                self._replace(broken)

    def _replace(self, worker: _Worker) -> None:
        """End a worker a fault left broken, and start a fresh one in its place."""
        worker.process.kill()
        self._retire(worker)
        self._spawn(worker)

    # -- concurrent.futures.Executor ----------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._shutdown:
                raise RuntimeError("cannot submit to an mpsrun.Executor after shutdown")
            self._pending.append(_Call(next(self._numbers), future, fn, args, kwargs))
        self._wake()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; ``cancel_futures``: the calls not started are cancelled. With ``wait`` the running ones
        finish first; then the workers end and the session closes (its daemons and directory go)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._pending:
                    self._pending.popleft().future.cancel()
        self._wake()
        if wait and threading.current_thread() is not self._manager:  # (a callback's shutdown cannot wait for it)
            self._manager.join()

    def _finish(self) -> None:
        self._sampling_ends.set()
        if self._sampler.is_alive():
            self._sampler.join()
        self._stop_workers()
        with self._wake_lock:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_write = -1
        self._session.close()
        if hasattr(self, "_at_exit"):  # (last: the program's exit waits for all of the above)
            atexit.unregister(self._at_exit)

    def _stop_workers(self) -> None:
        """End the workers (asked, then killed after 10 s), then what their calls started and left running."""
        left = [process for w in self._workers if w.process is not None and w.process.is_alive()
                for process in descendants(w.process.pid)]
        for worker in self._workers:
            if worker.connection is not None and worker.process is not None and worker.process.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    worker.connection.send(None)
        for worker in self._workers:
            if worker.process is None:
                continue
            with contextlib.suppress(Exception):
                worker.process.join(timeout=10)  # an exited worker stays a zombie until joined: its CPU is read
            if worker.process.is_alive():
                worker.process.kill()
            if worker.connection is not None and not worker.connection.closed:
                worker.wall += time.monotonic() - worker.started
                worker.connection.close()
                close_all([worker.exit_fd])
            worker.process.join()
        end_processes(left, _LEFTOVER_GRACE)  # (found before their workers ended: then they were init's)

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(OSError):  # (BlockingIOError: a wake-up is there already)
            if self._wake_write >= 0:
                os.write(self._wake_write, b"\0")

    # -- what it did ----------------------------------------------------------------------------------------------

    def accounts(self) -> list[WorkerAccount]:
        """Each worker slot's account so far (its live process's time and CPU count until now)."""
        now = time.monotonic()
        with self._lock:
            live = {w.index: w.connection is not None and not w.connection.closed for w in self._workers}
            pids = {w.process.pid: w.index for w in self._workers if live[w.index]}
            proven = self._proven(pids)
            peaks = self._usage.peaks if self._usage is not None else {}
            return [WorkerAccount(w.index, w.gpu, w.calls, w.failed, w.processes, proven.get(w.index),
                                  round(w.wall + (now - w.started if live[w.index] else 0), 3),
                                  round(w.cpu + (_cpu(w.process.pid) if live[w.index] else 0), 3),
                                  peaks.get(w.index))
                    for w in self._workers]

    def _proven(self, pids: Mapping[int, int]) -> dict[int, bool | None]:
        """Whether each worker (by number) has been an MPS client of the session's servers (their logs say so)."""
        if self._watch is None:
            return {}
        self._watch.settle(pids)
        return {index: True if index in self._watch.verified else None for index in pids.values()}

    @property
    def session(self) -> Session:
        """The executor's MPS session (its daemons, one per GPU; ``session.enabled``: whether MPS runs)."""
        return self._session


#: A worker's descriptors here: its connection, sentinel and pidfd, and while it starts its pipes to the new process.
_DESCRIPTORS_PER_WORKER = 6
#: What calls left running gets this long between SIGTERM and SIGKILL once its worker has ended.
_LEFTOVER_GRACE = 2.0


def _cpu(pid: int) -> float:
    """The CPU seconds of our child ``pid`` so far (also once it has exited and is not yet reaped); 0 if gone."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to what ``exc`` says when shown (Python 3.11's notes; before them, to its arguments)."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:  # pragma: no cover - Python 3.10
        exc.args = (*exc.args, text)
