"""Controllers: one job contract, applied to ranks wherever and however they were started.

Rank supervisors (and node keepers relaying for theirs) join through a :class:`~mpsrun.job.table.RankTable`. Every
controller welcomes each rank with its environment, watches that the ranks are MPS clients, and stops them the same
way: at the first failure, ``terminate_client`` for connected ranks, SIGTERM, ``--grace``, SIGKILL.

A :class:`Controller` is one loop over its ranks, composed with a :class:`Decider`, which says what a failure, a
rank's end and a signal mean: :class:`~mpsrun.job.judging.Judging` decides the job's outcome itself (the ``mpsrun``
command, a bare ``--per-node`` node), :class:`~mpsrun.node.relay.Relaying` tells the job's controller and carries out
its word (a node under ``mpsrun --hosts``). :mod:`mpsrun.job.jobcontroller` adds the job's launchers,
:mod:`mpsrun.node.controller` a node's life.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.job.outcome import Policy, RankEnd
from mpsrun.job.report import shared_memory_hint
from mpsrun.job.table import RankState, RankTable
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.usage import UsageSampler
from mpsrun.mps.watch import Finding, RankWatch, with_descendants
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import FORWARDED_SIGNALS, KILL_WAIT, PASS_SIGNALS, SAME_INTERRUPT
from mpsrun.runtime.files import publish
from mpsrun.runtime.loop import EventLoop, Timer
from mpsrun.runtime.processes import ProcessRef
from mpsrun.runtime.protocol import Found, Hello, Link, Listener, Note, Peaks, Refusal, SignalRanks, Started, Verdict
from mpsrun.session.session import Session

if TYPE_CHECKING:
    from mpsrun.job.account import RankAccount
    from mpsrun.job.placement import Admission, RankPlan

__all__ = ["Admit", "Controller", "Decider", "Policy"]

log = logging.getLogger("mpsrun")

#: What a controller gives each rank it admits (its environment and settings), from its identity and hello.
Admit = Callable[[RankIdentity, Hello], "Admission"]


class Decider(Protocol):
    """What a controller's events mean: who decides the job's outcome, and what a rank is told."""

    def arm(self) -> None:
        """Set what the loop waits for besides the ranks (a timeout, an upstream link)."""

    def fail(self, cause: str, code: int, message: str) -> None:
        """The job fails for a reason of its own (unless something failed first): stop the ranks."""

    def ended(self, state: RankState, end: RankEnd) -> None:
        """A rank has ended (its state holds its end)."""

    def stop_signal(self, sig: int, first: bool) -> None:
        """A stopping signal from outside; ``first``: the job's first."""

    def heeds_interrupt(self) -> bool:
        """Whether an interrupt a rank's supervisor reports stops the job now."""

    def link_closed(self, link: Link) -> None:
        """A rank supervisor's or node keeper's link has ended."""

    def started(self, state: RankState, message: Started) -> None:
        """A rank's program has started."""

    def warn(self, finding: Finding) -> None:
        """A finding of the client watch that does not fail the job."""

    def verdict_code(self, state: RankState) -> int:
        """The exit code a rank's supervisor is told, when no one else decided it."""

    def refusal_code(self) -> int:
        """The exit code of a rank turned away because the job is stopping."""

    def once(self, code: int, refusal: str) -> str:
        """What a refused rank says of ``refusal``: a refusal is said once."""

    def delivered(self, lines: list[str]) -> list[str]:
        """What a node's last verdict carries of ``lines`` (a relay sends them up instead)."""


class Controller(abc.ABC):
    """What every controller does: admit ranks, watch them, stop them. ``session``: the MPS session of this host's
    ranks, if this controller owns one (for the client watch and detaching). ``decider``: makes the
    :class:`Decider` of what a failure, a rank's end and a signal mean. Each kind of controller says when it is
    over (:meth:`_done`) and how it tells the user (:meth:`note`)."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, session: Session | None,
                 decider: Callable[[Controller], Decider]) -> None:
        self.welcome, self.policy, self.session = welcome, policy, session
        self.loop = EventLoop()
        self.table = RankTable(self.loop, listener, token, self, socket.gethostname())
        self.watch = RankWatch(session.watcher(), policy.mps_required) \
            if session is not None and session.enabled else None
        self.usage = UsageSampler([gpu.uuid for gpu in session.gpus], policy.keep_samples) \
            if session is not None and session.gpus else None
        self.stopping: int | None = None
        self.interrupted_by: int | None = None
        self._kill_timer: Timer | None = None
        self._detached = False
        self._interrupts: dict[int, float] = {}  # source -> when its first interrupt came
        self._unrecorded: list[ProcessRef] = []  # ranks started this turn of the loop, for the session's record
        self.lingering = False  # a rank told its end waits for this controller's process to end (a closed node's)
        self.decider = decider(self)

    @property
    def ranks(self) -> dict[int, RankState]:
        return self.table.ranks

    def run(self, first: Callable[[], object] | None = None, pending: Sequence[int] = ()) -> None:
        """Run to the end; ``first`` runs once the loop handles signals (it may raise MPSError). ``pending``:
        stopping signals that arrived before the loop took over (acted on first)."""
        with self.loop.signals(FORWARDED_SIGNALS, self._on_signal):
            self.decider.arm()
            if self.watch is not None:
                self.loop.after(self.policy.watch_interval, self._check)
            if self.usage is not None:
                self.loop.after(self.policy.usage_interval, self._sample)
            for sig in pending:
                self.loop.after(0, functools.partial(self._on_signal, sig))
            if first is not None:
                self.loop.after(0, lambda: self._guarded(first))
            with gpu_info.nvml_kept() if self.watch or self.usage else contextlib.nullcontext():
                self.loop.run_until(self._done)
        self.loop.close()

    def settle_watch(self) -> None:
        """Let the client watch read the daemons' logs once more, knowing every rank that ran."""
        if self.watch is not None:
            self.watch.settle({s.process.pid: s.rank for s in self.ranks.values() if s.process is not None})

    def account(self, state: RankState, first: bool = False) -> RankAccount:
        """A rank's account as this controller knows it (``first``: it failed first), or as its node keeper sent it."""
        from mpsrun.job.account import RankAccount  # at the job's end only: not on every job's path to its ranks

        end = state.end
        cause = end.what(first) if end is not None else "running"
        if end is not None and end.relayed is not None:
            return RankAccount.relayed(end.relayed, cause)
        plan = state.plan
        gpu, share = self._gpu_of(plan)
        pid = end.pid if end is not None and end.pid else state.process.pid if state.process is not None else None
        return RankAccount(
            state.rank, self.table.host, pid, gpu, self._proven(state.rank),
            self.usage.peaks.get(state.rank) if self.usage is not None else None,
            plan.mem_limit if plan is not None else None, share, plan.thread_percentage if plan is not None else None,
            end.wall if end is not None else None, end.cpu if end is not None else None,
            end.returncode if end is not None else None, cause)

    def accounts(self, first: int | None = None) -> list[RankAccount]:
        """Every rank's account, by rank (``first``: the rank whose failure decided the job)."""
        return [self.account(state, state.rank == first) for _, state in sorted(self.ranks.items())]

    def _gpu_of(self, plan: RankPlan | None) -> tuple[int | None, int | None]:
        """A rank's GPU (its index; None where it sees every GPU of the session, or none) and, where it shares that GPU
        with no memory limit, its share of the GPU's memory (MiB)."""
        if plan is None or self.session is None or not self.session.gpus or self.session.gpu_bind != "single":
            return None, None
        gpu, sharers = self.session.gpus[plan.gpu], plan.sharers or 1
        return gpu.index, (gpu.memory_total >> 20) // sharers if sharers > 1 and not plan.mem_limit else None

    def _proven(self, rank: int) -> bool | None:
        """Whether the rank was proven an MPS client (True), seen using its GPU without MPS (False), or neither."""
        if self.watch is None:
            return None
        return True if rank in self.watch.verified else False if rank in self.watch.without_mps else None

    @abc.abstractmethod
    def note(self, text: str) -> None:
        """Say something to the user (how depends on where the controller runs)."""

    @abc.abstractmethod
    def _done(self) -> bool:
        """Whether the loop is over."""

    def fail(self, cause: str, code: int, message: str) -> None:
        """The job fails for a reason of its own (unless something failed first): stop the ranks."""
        self.decider.fail(cause, code, message)

    def _ended(self, state: RankState, end: RankEnd) -> None:
        self.decider.ended(state, end)

    def _stop_signal(self, sig: int) -> None:
        first = self.interrupted_by is None
        if first:
            self.interrupted_by = sig
        self.decider.stop_signal(sig, first)

    # -- what the ranks say (mpsrun.job.table.RankEvents) -----------------------------------------

    def admit(self, link: Link, identity: RankIdentity, hello: Hello) -> None:
        """Welcome a rank with its environment, or refuse it (the refusal is then its end)."""
        known = identity.rank in self.ranks
        refusal = self._refusal(identity)
        if refusal is None:
            try:
                admission = self.welcome(identity, hello)
                link.send(admission.welcome)
                self.table.add(RankState(identity.rank, link, unlimited_gpu=admission.unlimited_gpu,
                                         plan=admission.plan))
                return
            except MPSError as exc:
                refusal = (exc.exit_code, f"mpsrun: error: {exc}")
        code, why = refusal
        message = self.decider.once(code, why)
        if not known:  # the refusal is its verdict; its end may be the node's last, which closes the node first
            state = self.table.add(RankState(identity.rank))
            self.rank_ended(state, RankEnd(identity.rank, None, code, why.removeprefix("mpsrun: error: ")))
        link.send(Refusal(code, message, linger=self.lingering))
        self.table.close(link)

    def _refusal(self, identity: RankIdentity) -> tuple[int, str] | None:
        """Why this rank may not join (its exit code and what to say), or None. Once the job is stopping, nothing
        is said: a rank given up as never started may still come then, and is not a second rank of its number."""
        if self.stopping is not None:
            return self.decider.refusal_code(), ""
        if identity.rank in self.ranks:
            return ExitCode.SETUP, f"rank {identity.rank} is already part of this job"
        return None

    def rank_started(self, state: RankState, message: Started) -> None:
        self.decider.started(state, message)
        if state.process is not None and self.session is not None:
            if not self._unrecorded:  # one write of the record for the ranks that start in one turn, not one each
                self.loop.after(0, self._record_started)
            self._unrecorded.append(state.process)
        if self.stopping is not None:  # started while the job was already stopping
            self.signal_ranks(self.stopping, [state])

    def _record_started(self) -> None:
        if self.session is not None:
            self.session.add_ranks(self._unrecorded)
        self._unrecorded = []

    def rank_ended(self, state: RankState, end: RankEnd) -> None:
        if end.returncode != 0 and self.stopping is None:  # a failure of its own, not an end the job's stop caused
            for finding in self.watch.dead_daemons() if self.watch is not None else ():  # its server went away
                self._finding(finding)
            if end.returncode is not None and not end.reason and state.unlimited_gpu is not None:
                end = replace(end, reason=shared_memory_hint(self.session, *state.unlimited_gpu))
        state.ended(end)
        self._ended(state, end)

    def interrupted(self, sig: int, source: int) -> None:
        """A rank's supervisor (or a node keeper) got a stopping signal from outside. srun and mpiexec send one to every
        rank, so one from each ``source`` (a connection) is one interrupt; a SIGINT from the same source again, later
        than a terminal and a launcher would deliver one Ctrl-C twice, is the user's second Ctrl-C: kill at once."""
        if not self.decider.heeds_interrupt():
            return
        now = time.monotonic()
        first = self._interrupts.setdefault(source, now)
        if self.interrupted_by is None or (sig == signal.SIGINT and now - first > SAME_INTERRUPT):
            self._on_signal(sig)

    def relayed(self, message: Found | Note | Peaks) -> None:  # noqa: B027 - an event, not a hook: see RankEvents
        """A node keeper's finding or note: only a multi-host job's controller has node keepers (it overrides this)."""

    def link_closed(self, link: Link) -> None:
        """A rank supervisor's or node keeper's link has ended (its live ranks were given up as lost)."""
        self.decider.link_closed(link)

    def node_closed(self) -> None:  # noqa: B027 - an event, not a hook: see RankEvents
        """A node keeper's link ended: only a multi-host job's controller has node keepers (it overrides this)."""

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self, sig: int, restart: bool = False) -> None:
        """Start no more ranks; detach connected ranks from MPS, send ``sig`` to every rank; SIGKILL after --grace."""
        if self.stopping is not None and not restart:
            return
        self.stopping = sig
        self.detach_once()
        self.signal_ranks(sig, self.table.live())
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._kill_timer = self.loop.after(self.policy.grace, self._kill)

    def _kill(self) -> None:
        """``--grace`` is over: SIGKILL; a rank that still does not report is given up as lost."""
        self.signal_ranks(signal.SIGKILL, self.table.live())
        self.loop.after(KILL_WAIT, self._lost)

    def kill_now(self) -> None:
        """SIGKILL every rank at once (a second Ctrl-C)."""
        self.signal_ranks(signal.SIGKILL, self.table.live())

    def _lost(self) -> None:
        for state in self.table.live():
            pid = state.process.pid if state.process is not None else None
            self.rank_ended(state, RankEnd(state.rank, pid, None, "no word from it after SIGKILL"))

    def _never_started(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            self.table.add(RankState(rank, end=RankEnd(rank, None, None, "never started"), verdict_sent=True))

    def _clients_gone(self) -> None:
        """Every rank has ended: no client is left to detach, and the session's daemons may begin to quit."""
        self._detached = True
        if self.session is not None:
            self.session.begin_close()

    def detach_once(self) -> None:
        if self.watch is None or self.session is None or self._detached:
            return
        self._detached = True
        try:
            if detached := self.session.detach_clients(list(with_descendants(self.table.local_pids()))):
                log.info(f"mpsrun: detached {len(detached)} rank process(es) from MPS before stopping them: their "
                         "CUDA calls now fail with CUDA_ERROR_MPS_CLIENT_TERMINATED")
        except MPSError as exc:  # stopping must go on
            self.note(f"could not detach ranks from MPS before stopping them: {exc}")

    def signal_ranks(self, sig: int, states: Iterable[RankState]) -> None:
        by_link: dict[Link, list[int]] = {}
        for state in states:
            if state.end is not None:
                continue
            if state.link is not None and state.link.usable:
                by_link.setdefault(state.link, []).append(state.rank)
                if sig == signal.SIGKILL and state.process is not None:  # also past a supervisor that reads no
                    state.process.signal_group(sig)  # more (stopped): the program it started ends all the same
            elif state.process is not None:
                state.process.signal_group(sig)
        for link, ranks in by_link.items():
            link.send(SignalRanks(sig, ranks))

    def verdict(self, state: RankState, code: int | None = None, lines: Sequence[str] = ()) -> None:
        """Tell a rank's supervisor how the job ended for it (once); ``code``: as decided elsewhere."""
        if state.verdict_sent:
            return
        state.judged()
        lines, linger = self._verdict_lines(state, list(lines))
        if state.link is not None:
            state.link.send(Verdict(state.rank, self.decider.verdict_code(state) if code is None else code, lines,
                                    linger))

    def judged_before_report(self, link: Link, state: RankState) -> None:
        """A node keeper reports the end of a rank decided here before its report came (given up as never started
        when its launcher ended): the keeper gets the rank's verdict, or would wait for it until its own deadline."""
        link.send(Verdict(state.rank, self.decider.verdict_code(state)))

    def _verdict_lines(self, state: RankState, lines: list[str]) -> tuple[list[str], bool]:
        """What a rank's supervisor says with its verdict, and whether it waits (lingers) for the node's end."""
        return lines, False

    # -- events -----------------------------------------------------------------------------------

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except MPSError as exc:
            self.fail("setup", exc.exit_code, str(exc))

    def _on_signal(self, sig: int) -> None:
        if sig in PASS_SIGNALS:
            self.signal_ranks(sig, self.table.live())
        else:
            self._stop_signal(sig)

    def _check(self) -> None:
        if self.watch is None or self.stopping is not None or self._detached or not self.table.accepting:
            return
        for finding in self.watch.check(self.table.local_pids()):
            self._finding(finding)
        self.loop.after(self.policy.watch_interval, self._check)

    def _sample(self) -> None:
        """One sample of the live ranks' device memory, while the job runs."""
        if self.usage is None or self.stopping is not None or not self.table.accepting:
            return
        pids = self.table.local_pids()
        if pids and self.usage.sample(with_descendants(pids)):
            self._peaks_grew(self.usage.peaks)
        self.loop.after(self.policy.usage_interval, self._sample)

    def _peaks_grew(self, peaks: dict[int, int]) -> None:
        """A rank's peak device memory grew: published in the session's directory, for ``mpsrun top``."""
        if self.session is not None and self.session.dirs is not None:
            publish(self.session.dirs.usage_file, {
                str(rank): {"host": self.table.host, "pid": state.process.pid, "peak": peaks.get(rank)}
                for rank, state in sorted(self.ranks.items()) if state.process is not None})

    def _finding(self, finding: Finding) -> None:
        if finding.fatal:
            self.fail("check-failed", ExitCode.SETUP if finding.code is None else finding.code, finding.message)
        else:
            self.decider.warn(finding)
