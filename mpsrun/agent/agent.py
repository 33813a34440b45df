"""The agent: one node's part of a job, from its session's start to its end, on every path.

It runs inside the ``mpsrun`` command under ``--launcher local`` and ``mpiexec``, and as a process of its own (the
node keeper, :mod:`mpsrun.agent.keeper`) under ``--per-node`` and on each host under ``--hosts``. It plans the node's
ranks, opens the node's MPS session, welcomes each rank's supervisor with its environment, watches that the ranks are
MPS clients, samples their device memory, stops them when told, gives each its verdict, and closes the session. What
its events mean is decided above it, by its :class:`Top`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

from mpsrun.agent.outcome import Policy, RankEnd, ranges
from mpsrun.agent.ranks import Doorway, RankState
from mpsrun.config.options import JobConfig, differing_options
from mpsrun.errors import ConfigError, DaemonError, DaemonTimeoutError, JobTimeoutError, MPSError
from mpsrun.exitcodes import ExitCode, Outcome, exit_code
from mpsrun.mps.placement import NodePlan, RankPlan, without_mps
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import DAEMON_START_TIMEOUT, KILL_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.files import publish
from mpsrun.runtime.loop import EventLoop, Timer
from mpsrun.runtime.processes import ProcessRef, kill_group
from mpsrun.runtime.protocol import (
    Ended,
    Exited,
    Hello,
    Interrupted,
    Link,
    Listener,
    Message,
    Refusal,
    Say,
    SignalRanks,
    Started,
    Verdict,
    Welcome,
)
from mpsrun.session.claim import SessionClaim
from mpsrun.session.session import Session

if TYPE_CHECKING:  # imported as the daemons start (the command's AFTER_START), or where first needed
    from mpsrun.agent.account import RankAccount
    from mpsrun.mps.usage import UsageSampler
    from mpsrun.mps.watch import Finding, RankWatch

#: What a started agent uses: imported while the daemons come up, not before them on every job's path.
AFTER_START = ("hmac", "mpsrun.agent.account", "mpsrun.agent.findings", "mpsrun.agent.welcome", "mpsrun.mps.usage",
               "mpsrun.mps.watch")

__all__ = ["Agent", "ServerCue", "Top", "Welcoming"]

log = logging.getLogger("mpsrun")


class Top(Protocol):
    """Who decides above an agent (:class:`~mpsrun.agent.decision.Decision`, or under --hosts the link to the job's
    command): what the agent's events mean, and each rank's verdict."""

    def rank_started(self, started: Started) -> None: ...

    def rank_ended(self, ended: Ended) -> None: ...

    def refused(self, code: int, message: str) -> str:
        """What a rank refused for ``message`` says (a refusal is said once)."""

    def failed(self, code: int, message: str) -> None:
        """The node fails the job for a reason of its own (the watch's finding)."""

    def warned(self, message: str) -> None: ...

    def interrupted(self, sig: int, source: int) -> None:
        """A stopping signal reached a rank's supervisor (``source``: its link) or the agent itself (0)."""

    def verdict(self, own: int, deliverable: bool) -> tuple[int, list[str]]:
        """A rank's exit code (its ``own``, or the job's once decided) and what its supervisor says with it."""

    def closing(self, lines: list[str]) -> list[str]:
        """The node's last words: what its last rank's verdict carries of them."""

    def peaks(self, peaks: dict[int, int]) -> None: ...


class Welcoming(NamedTuple):
    """How a node welcomes its ranks. ``ranks``: the job's ranks, where this node runs them all (the command's own
    node; the launcher may not say the sizes); ``callers``: the caller's environment, put back where a launcher
    rewrote it; ``output``: the stdout and stderr (descriptors of ours) that the ranks write to, each line under one
    lock; they come with each welcome (an MPI launcher's forwarding cuts lines of different ranks); ``settings`` and
    ``devices``: what every rank of a --per-node job must have been started with; ``extra``: variables of a one-node
    --per-node job (its rendezvous); ``notices``: said by the first rank."""

    ranks: range | None = None
    callers: Mapping[str, str | None] | None = None
    output: tuple[int, int] | None = None
    settings: str | None = None
    devices: str | None = None
    extra: Mapping[str, str] | None = None
    notices: bool = False


class ServerCue:
    """When to ask for each MPS server: ``after`` seconds once the last of ``ranks`` has started (None: never, its first
    client starts it). Not at the first rank's start: a job of many short ranks would still be starting its last ones
    then, and would pay for a server none of them uses (its start, then its quit before the daemon's)."""

    def __init__(self, ranks: Iterable[int], after: float | None) -> None:
        self._waiting = set(ranks) if after is not None else set()
        self._after = after

    def started(self, rank: int) -> float | None:
        """The delay to ask after, once: when ``rank`` was the last to start; else None."""
        if not self._waiting:
            return None
        self._waiting.discard(rank)
        return None if self._waiting else self._after


class Agent:
    """One node's part of a job. Built, it holds the node's claim (``claim``: its directory, made already) and the
    ``listener`` in it, where ranks that show ``token`` join; :meth:`start` plans the ranks and starts the daemons;
    the owner of ``loop`` runs it; :meth:`close` ends the session. ``local_size`` and ``world_size``: the node's and
    the job's ranks, where known; ``deadline``: the job's ``--timeout``; ``closing``: under --per-node, the node's end
    before its last rank's verdict (None while ranks are still awaited; the ranks then wait for the agent's process
    to end), and ``awaited``: whether ranks of the node have yet to come; ``server_after``: when to ask for each MPS
    server after the last rank started (None: its first client starts it)."""

    def __init__(self, config: JobConfig, loop: EventLoop, top: Top, claim: SessionClaim, listener: Listener,
                 token: str, deadline: Deadline, *, welcoming: Welcoming, local_size: int | None,
                 world_size: int | None, server_after: float | None = None,
                 closing: Callable[[], list[str] | None] | None = None,
                 awaited: Callable[[], bool] | None = None) -> None:
        self.config, self.loop, self.top, self.deadline = config, loop, top, deadline
        self.welcoming, self.local_size, self.world_size = welcoming, local_size, world_size
        self.host = socket.gethostname()
        self.session = Session(gpus=list(config.gpus) if config.gpus is not None else "all", mps=config.mps,
                               keep_logs=config.keep_logs, export=False, gpu_bind=config.gpu_bind,
                               start_timeout=max(0.1, deadline.cap(DAEMON_START_TIMEOUT)), claim=claim)
        assert claim.dirs is not None
        self.dirs, self.listener = claim.dirs, listener
        self.doorway = Doorway(loop, self.listener, token, self._hello, self._message, self._lost)
        self.ranks: dict[int, RankState] = {}
        self.plan: NodePlan | None = None
        self.watch: RankWatch | None = None
        self.usage: UsageSampler | None = None
        self.policy = Policy.for_job(config, deadline)
        self.stopping: int | None = None
        self.refusing: tuple[int, str] | None = None  # every rank that comes is refused so (a job that cannot run)
        self.lingering = False  # a rank told its end from now on waits for the agent's process to end
        self._closing, self._awaited = closing, awaited
        self._by_link: dict[Link, RankState] = {}
        self._kill_timer: Timer | None = None
        self._detached = False
        self._server_cue = ServerCue(welcoming.ranks or (), server_after)
        self._unrecorded: list[ProcessRef] = []  # ranks started this turn of the loop, for the session's record
        self._duplicates = 0
        self._output_lock: str | None = None

    @property
    def duplicates(self) -> int:
        """Ranks refused for a number another rank of the node has (each took a place the launcher announced)."""
        return self._duplicates

    # -- the node's session -------------------------------------------------------------------------------------

    def start(self, meanwhile: Callable[[], object] | None = None) -> None:
        """Read the GPUs, plan the node's ranks on them (refusing what cannot be honoured) and start the daemons
        with the plan's defaults; ``meanwhile`` runs while they come up. Daemons still starting when the job's
        deadline passed are the job's timeout."""
        session = self.session
        session.resolve()
        self.plan = NodePlan.make(self.config, len(session.gpus), self.local_size, session.free_memory(),
                                  self.world_size)
        if self.welcoming.ranks is not None:
            self.plan.ranks(len(self.welcoming.ranks))  # every rank checked before anything starts
        try:
            session.start_lazy(self.plan.daemon_defaults(), meanwhile)
        except DaemonTimeoutError as exc:
            if self.deadline.expired():
                whose = "the" if self.welcoming.ranks is not None else "this node's"
                raise JobTimeoutError(f"timed out after {self.config.timeout:g} s while {whose} MPS daemons started "
                                      f"({exc})", timeout=self.config.timeout or 0.0) from None
            raise
        self.policy = Policy.for_job(self.config, self.deadline)  # with what the start left of --timeout
        from mpsrun.mps.usage import UsageSampler
        from mpsrun.mps.watch import RankWatch

        if session.enabled:
            self.watch = RankWatch(session.watcher(), self.policy.mps_required)
        if session.gpus:
            self.usage = UsageSampler([gpu.uuid for gpu in session.gpus], self.policy.keep_samples)
        if self.welcoming.output is not None:  # each rank writes its lines under it
            try:
                self.dirs.output_lock.touch(mode=0o600)
            except OSError as exc:  # (no room): a set-up failure like any, the launcher's ranks turned away quietly
                raise MPSError(f"cannot make {self.dirs.output_lock}: {exc.strerror}") from None
            self._output_lock = str(self.dirs.output_lock)

    def notices(self) -> list[str]:
        """What to say once when the node's ranks run without MPS (nothing when they run under it)."""
        reason = self.session.disabled_reason
        return [] if reason is None else without_mps(self.config, reason, gpus_seen=bool(self.session.gpus))

    def run_in(self) -> None:
        """Arm the watch and the memory samples in the loop (its owner runs it)."""
        if self.watch is not None:
            self.loop.after(self.policy.watch_interval, self._check)
        if self.usage is not None:
            self.loop.after(self.policy.usage_interval, self._sample)

    def abandon(self) -> None:
        """The job cannot run (its set-up failed after its MPI launcher had started): every rank that comes is
        refused quietly with exit 0 (no launcher's banner)."""
        self.refusing = (ExitCode.OK, "")

    def begin_close(self) -> None:
        """Every rank has ended: the daemons may begin to quit while the launchers exit, and the ranks that linger
        go together (in the loop's next turn: the last one's verdict is still to be sent)."""
        self._detached = True
        self.session.begin_close()
        self.loop.after(0, self.let_go)

    def close(self) -> None:
        """Stop admitting ranks and end the session (daemons, directory, reaper); TeardownError for what failed."""
        self.doorway.close_door()
        self.listener.close()
        self.session.close()

    # -- the ranks ----------------------------------------------------------------------------------------------

    def live(self) -> list[RankState]:
        return [state for state in self.ranks.values() if state.end is None]

    def pids(self) -> dict[int, int]:
        """``{pid: rank}`` of the live ranks."""
        return {s.process.pid: s.rank for s in self.live() if s.process is not None}

    def settle_watch(self) -> None:
        """Let the client watch read the daemons' logs once more, knowing every rank that ran."""
        if self.watch is not None:
            self.watch.settle({s.process.pid: s.rank for s in self.ranks.values() if s.process is not None})

    def ended(self, state: RankState) -> Ended:
        """A rank's end with its account, as the job's command hears of it."""
        end, plan, session = state.end, state.plan, self.session
        assert end is not None
        gpu = share = None
        if plan is not None and session.gpus and session.gpu_bind == "single":
            device = session.gpus[plan.gpu]
            gpu = device.index
            if plan.unlimited_sharing:
                share = (device.memory_total >> 20) // (plan.sharers or 1)
        peak = self.usage.peaks.get(state.rank) if self.usage is not None else None
        return Ended(state.rank, end.returncode, end.reason, end.aborting, end.host or self.host, end.pid, gpu,
                     self._proven(state.rank), peak, plan.mem_limit if plan else None, share,
                     plan.thread_percentage if plan else None, end.wall, end.cpu)

    def _proven(self, rank: int) -> bool | None:
        """Whether the rank was proven an MPS client (True), seen using its GPU without MPS (False), or neither."""
        if self.watch is None:
            return None
        return True if rank in self.watch.verified else False if rank in self.watch.without_mps else None

    def accounts(self, first: int | None = None) -> list[RankAccount]:
        """Every rank's account, by rank (``first``: the rank whose failure decided the job)."""
        from mpsrun.agent.account import RankAccount

        return [RankAccount.of(self.ended(state), state.end.what(rank == first))
                for rank, state in sorted(self.ranks.items()) if state.end is not None]

    def _hello(self, link: Link, hello: Hello) -> None:
        """Welcome a rank with its environment, or refuse it (the refusal is then its end)."""
        try:
            identity = RankIdentity.checked(hello.rank, hello.local_rank, hello.world_size, hello.local_world_size)
        except ValueError as exc:
            link.send(Refusal(ExitCode.SETUP, f"mpsrun: bad hello: {exc}"))
            self.doorway.close(link)
            return
        link.admit()
        known = identity.rank in self.ranks
        refusal = self._refusal(identity)
        if refusal is None:
            try:
                sent, plan = self._welcome(identity, hello)
                link.send(sent, self.welcoming.output or ())
                self.ranks[identity.rank] = self._by_link[link] = RankState(identity.rank, link, plan=plan)
                return
            except MPSError as exc:
                refusal = (exc.exit_code, f"mpsrun: error: {exc}")
        code, why = refusal
        message = self.top.refused(code, why) if why else ""
        if not known:  # the refusal is its end; that end may be the node's last, which closes the node first
            self.ranks[identity.rank] = RankState(identity.rank)
            self._ended(self.ranks[identity.rank], RankEnd(identity.rank, None, code, why.removeprefix(
                "mpsrun: error: ")))
        link.send(Refusal(code, message, linger=self.lingering))
        self.doorway.close(link, linger=self.lingering)

    def _refusal(self, identity: RankIdentity) -> tuple[int, str] | None:
        """Why this rank may not join (its exit code and what to say), or None. Once the job is stopping nothing is
        said: a rank given up as never started may still come then, and is not a second rank of its number."""
        expected = self.welcoming.ranks
        if expected is not None and identity.rank not in expected and identity.rank not in self.ranks:
            return ExitCode.SETUP, f"rank {identity.rank} is not part of this job (ranks {ranges(expected)})"
        if self.refusing is not None:
            return self.refusing
        if self.stopping is not None or self.plan is None:
            return self.top.verdict(ExitCode.OK, False)[0], ""
        if identity.rank in self.ranks:
            self._duplicates += 1
            return ExitCode.SETUP, f"rank {identity.rank} is already part of this job"
        return None

    def _welcome(self, identity: RankIdentity, hello: Hello) -> tuple[Welcome, RankPlan | None]:
        """A rank's welcome by the node's plan, checked against what the rank was started with."""
        rules, plan = self.welcoming, self.plan
        assert plan is not None
        if rules.settings is not None and hello.settings != rules.settings:
            differ = differing_options(json.loads(rules.settings), _settings(hello.settings))
            raise ConfigError(f"rank {identity.rank} was started with other mpsrun options than the rank that started "
                              f"this node's session ({', '.join(differ)}); every rank of a per-node job needs the same",
                              setting="options")
        if rules.settings is not None and hello.devices != rules.devices:
            raise ConfigError("the ranks on this node see different GPUs (CUDA_VISIBLE_DEVICES "
                              f"{hello.devices!r}, not {rules.devices!r}); mpsrun --per-node needs "
                              "every local rank to see the node's GPUs (no per-task GPU binding)", setting="gpus")
        if rules.ranks is not None:  # the command's own node: what the launcher did not say, the job knows
            n = len(rules.ranks)
            identity = identity._replace(world_size=identity.world_size or n,
                                         local_world_size=identity.local_world_size or n)
        one_node = identity.world_size is not None and identity.world_size == self.local_size
        notices = self.notices() if rules.notices and not self.ranks and not self.config.quiet else []
        from mpsrun.agent.welcome import mpi4py_abort, welcome

        return welcome(identity, plan, self.session.target, mpi4py_abort(self.config.mpi4py_abort),
                       session_dir=str(self.dirs.root), output_lock=self._output_lock, callers=rules.callers,
                       extra=rules.extra if one_node else None, lines=notices)

    def _message(self, link: Link, message: Message) -> None:
        state = self._by_link.get(link)
        if state is None or state.end is not None:
            return
        if isinstance(message, Started):
            state.process = ProcessRef(message.pid, message.start) if message.start is not None else None
            self._started(state, message)
        elif isinstance(message, Exited):
            pid = state.process.pid if state.process is not None else message.pid
            self._ended(state, RankEnd(state.rank, pid, message.returncode, message.reason, message.aborting,
                                       message.wall, message.cpu))
        elif isinstance(message, Interrupted):
            self.top.interrupted(message.signal, id(link))

    def _started(self, state: RankState, message: Started) -> None:
        self.top.rank_started(message._replace(rank=state.rank, host=self.host))
        if state.process is not None:
            if not self._unrecorded:  # one write of the record for the ranks that start in one turn, not one each
                self.loop.after(0, self._record_started)
            self._unrecorded.append(state.process)
        if self.stopping is not None:  # started while the job was already stopping
            self._signal(self.stopping, [state])
        if (delay := self._server_cue.started(state.rank)) is not None:
            self.loop.after(delay, self._ask_servers)

    def _record_started(self) -> None:
        self.session.add_ranks(self._unrecorded)
        self._unrecorded = []

    def _ask_servers(self) -> None:
        """Start each server before its first client needs it, unless the job is stopping or its ranks are over
        (the daemons may be quitting already)."""
        if self.stopping is not None or not self.live():
            return
        for daemon in self.session.daemons:
            try:
                daemon.start_server(wait=False)
            except DaemonError as exc:  # the watch reports a daemon that died
                log.debug("mpsrun: could not ask for an MPS server: %s", exc)

    def _lost(self, link: Link) -> None:
        """A rank's supervisor is gone: its rank is lost, and what its program left is killed."""
        state = self._by_link.pop(link, None)
        if state is None or state.end is not None:
            return
        pid = state.process.pid if state.process is not None else None
        if pid is not None:  # its leader died with its supervisor; end what it left
            kill_group(pid, signal.SIGKILL)
        self._ended(state, RankEnd(state.rank, pid, None, "its supervisor is gone"))

    def _ended(self, state: RankState, end: RankEnd) -> None:
        if end.returncode != 0 and self.stopping is None:  # a failure of its own, not an end the job's stop caused
            for finding in self.watch.dead_daemons() if self.watch is not None else ():  # its server went away
                self._finding(finding)
            if end.returncode is not None and not end.reason and state.plan is not None \
                    and state.plan.unlimited_sharing:
                from mpsrun.agent.findings import shared_memory_hint

                end = end._replace(reason=shared_memory_hint(self.session, state.plan.gpu, state.plan.sharers or 1))
        state.end = end
        self.settle_watch()  # its MPS membership as the logs say it by now, for its account
        self.top.rank_ended(self.ended(state))
        self._verdict(state)

    def never_started(self, ranks: Iterable[int]) -> None:
        """Ranks that will never start (the job stopped before they were launched)."""
        for rank in ranks:
            if rank not in self.ranks:
                self.ranks[rank] = RankState(rank, end=RankEnd(rank, None, None, "never started"), verdict_sent=True)

    def _verdict(self, state: RankState) -> None:
        """Tell a rank's supervisor how the job ended for it (once). It waits (lingers) until every rank of the node
        has ended (see Verdict), unless it is about to call MPI_Abort, which ends the others, or ranks of the node
        have yet to join (its launcher might start them only after its end, or wait for it before it says that one
        was lost). A keeper's ranks wait for its process's end, and its last rank carries the node's last words, its
        session closed first (``closing``: None while ranks are still awaited)."""
        if state.verdict_sent:
            return
        state.verdict_sent = True
        code, lines = self.top.verdict(_own_code(state.end), state.link is not None and state.link.usable)
        last = self._closing() if self._closing is not None and self.settled() else None
        if last is not None:
            self.lingering = True
            lines += self.top.closing(last)
        if state.link is not None:
            aborting = state.end is not None and state.end.aborting
            linger = last is not None or not (aborting or self._still_awaited())
            state.link.send(Verdict(code, lines, linger=linger, outlive=self._closing is not None,
                                    last=last is not None))

    def _still_awaited(self) -> bool:
        """Whether ranks of the node have yet to join (a node keeper's arrivals, else the ranks the command launches):
        a launcher that lost one before it joined ends only once the others have."""
        if self._awaited is not None:
            return self._awaited()
        expected = self.welcoming.ranks
        return expected is not None and any(rank not in self.ranks for rank in expected)

    def let_go(self) -> None:
        """Ranks that linger for the agent need not wait for it any more: their links are closed."""
        for state in self.ranks.values():
            if state.link is not None and not state.link.closed:
                self.doorway.close(state.link)
        self.doorway.let_go()

    def settled(self) -> bool:
        """Every rank has ended and had its verdict."""
        return all(s.end is not None and s.verdict_sent for s in self.ranks.values())

    # -- stopping -----------------------------------------------------------------------------------------------

    def stop(self, sig: int, restart: bool = False) -> None:
        """Start no more ranks; detach connected ranks from MPS, send ``sig`` to every rank; SIGKILL after --grace."""
        if self.stopping is not None and not restart:
            return
        self.stopping = sig
        self._detach_once()
        self._signal(sig, self.live())
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._kill_timer = self.loop.after(self.policy.grace, self._kill)

    def _kill(self) -> None:
        """``--grace`` is over: SIGKILL; a rank that still does not report is given up as lost."""
        self.signal(signal.SIGKILL)
        self.loop.after(KILL_WAIT, self._given_up)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every live rank: SIGKILL at once (a second Ctrl-C), SIGUSR1 and SIGUSR2 passed on."""
        self._signal(sig, self.live())

    def _given_up(self) -> None:
        for state in self.live():
            pid = state.process.pid if state.process is not None else None
            self._ended(state, RankEnd(state.rank, pid, None, "no word from it after SIGKILL"))

    def _detach_once(self) -> None:
        """``terminate_client`` for the ranks that are MPS clients: NVIDIA's safe way to stop a client with GPU work
        in flight (a kill is undefined behaviour for the others)."""
        if self.watch is None or self._detached:
            return
        self._detached = True
        from mpsrun.mps.watch import with_descendants

        try:
            if detached := self.session.detach_clients(list(with_descendants(self.pids()))):
                log.info(f"mpsrun: detached {len(detached)} rank process(es) from MPS before stopping them: their "
                         "CUDA calls now fail with CUDA_ERROR_MPS_CLIENT_TERMINATED")
        except MPSError as exc:  # stopping must go on
            self.top.warned(f"could not detach ranks from MPS before stopping them: {exc}")

    def _signal(self, sig: int, states: Iterable[RankState]) -> None:
        for state in states:
            if state.link is not None and state.link.usable:
                state.link.send(SignalRanks(sig))
                if sig == signal.SIGKILL and state.process is not None:  # also past a supervisor that reads no
                    state.process.signal_group(sig)  # more (stopped): the program it started ends all the same
            elif state.process is not None:
                state.process.signal_group(sig)

    def say(self, text: str) -> bool:
        """Say a line through one of the live ranks' supervisors (a node whose voice they are)."""
        return any(s.link.send(Say(text)) for s in sorted(self.live(), key=lambda s: s.rank) if s.link is not None)

    # -- watching -----------------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.watch is None or self.stopping is not None or self._detached or not self.doorway.open:
            return
        for finding in self.watch.check(self.pids()):
            self._finding(finding)
        self.loop.after(self.policy.watch_interval, self._check)

    def _finding(self, finding: Finding) -> None:
        if finding.fatal:
            self.top.failed(ExitCode.SETUP if finding.code is None else finding.code, finding.message)
        else:
            self.top.warned(finding.message)

    def _sample(self) -> None:
        """One sample of the live ranks' device memory, while the job runs; a peak that grew is published in the
        session's directory, for ``mpsrun top``."""
        if self.usage is None or self.stopping is not None or not self.doorway.open:
            return
        from mpsrun.mps.watch import with_descendants

        pids = self.pids()
        if pids and self.usage.sample(with_descendants(pids)):
            peaks = self.usage.peaks
            publish(self.dirs.usage_file, {str(rank): {"host": self.host, "pid": state.process.pid,
                                                       "peak": peaks.get(rank)}
                                           for rank, state in sorted(self.ranks.items()) if state.process is not None})
            self.top.peaks(dict(peaks))
        self.loop.after(self.policy.usage_interval, self._sample)


def _own_code(end: RankEnd | None) -> int:
    """A rank's own exit code, as its end gives it."""
    returncode = end.returncode if end is not None else 0
    return exit_code(Outcome("ok" if returncode == ExitCode.OK else "rank-failed", returncode))


def _settings(text: str) -> dict[str, object]:
    """A rank's settings as it sent them (what is not a JSON object: none)."""
    with contextlib.suppress(ValueError):
        found = json.loads(text)
        if isinstance(found, dict):
            return found
    return {}
