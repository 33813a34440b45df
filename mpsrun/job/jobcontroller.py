"""The ``mpsrun`` command's controller: every rank of the job, and the processes that start them.

It knows the job's ranks (``-np``), starts them through its backend's launchers
(:mod:`mpsrun.job.launch`), and judges the job: the first failure decides the exit code and the
summary. Under ``--hosts`` each host's node keeper relays its ranks here
(:class:`~mpsrun.node.relay.Relaying`), so fail-fast spans all hosts.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from mpsrun.errors import DaemonError
from mpsrun.exitcodes import ExitCode, describe_returncode
from mpsrun.job.controller import Admit, Controller
from mpsrun.job.judging import Judging
from mpsrun.job.launch import Launched, Launchers, LaunchSpec
from mpsrun.job.outcome import JobResult, Policy, RankEnd, ranges
from mpsrun.job.table import RankState
from mpsrun.mps.watch import Finding
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import ABANDON_WAIT, LAUNCHER_REPORT_WAIT, NODE_CLOSE_WAIT, STOP_SIGNALS
from mpsrun.runtime.files import publish
from mpsrun.runtime.protocol import Found, Listener, Note, Peaks, Started
from mpsrun.session.session import Session

__all__ = ["JobController"]

log = logging.getLogger("mpsrun")


def unheard(hosts: Sequence[str], heard: set[str]) -> list[str]:
    """The other hosts, of ``hosts`` as ``--hosts`` names them, from which no node keeper came (a keeper names its
    host by its own host name; names are compared short). This host is left out: its launcher starts it without a
    remote shell, and when the launcher failed elsewhere first, its keeper never came either."""
    here = {_short(name) for name in heard} | {"localhost", _short(socket.gethostname())}
    return [host for host in hosts if _short(host) not in here and not _loopback(host)]


def _short(name: str) -> str:
    return name.split(".", 1)[0]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


class ServerCue:
    """When to ask for each MPS server: ``after`` seconds once the last of ``ranks`` has started (None: never, its first
    client starts it). Not at the first rank's start: a job of many short ranks would still be starting its last ones
    then, and would pay for a server none of them uses (its start, then its quit before the daemon's)."""

    def __init__(self, ranks: range, after: float | None) -> None:
        self._waiting = set(ranks) if after is not None else set()
        self._after = after

    def started(self, rank: int) -> float | None:
        """The delay to ask after, once: when ``rank`` was the last to start; else None."""
        if not self._waiting:
            return None
        self._waiting.discard(rank)
        return None if self._waiting else self._after


class JobController(Controller):
    """``ranks``: the job's ranks (0..N-1). ``early``: its MPI launcher, when it was started before the session
    (it is watched from the start). ``server_after``: when to ask for each MPS server, in seconds after the last
    of its ranks has started (None: its first client starts it). ``note``: how to tell the user. ``usage_file``: under
    ``--hosts``, where to publish each rank's host, pid and peak device memory for ``mpsrun top``."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, *, ranks: int,
                 session: Session | None, note: Callable[[str], None], early: Launched | None = None,
                 server_after: float | None = None, usage_file: Path | None = None) -> None:
        super().__init__(listener, token, welcome, policy, session,
                         functools.partial(Judging, timeout_applies=self._timeout_applies))
        assert isinstance(self.decider, Judging)
        self.judging = self.decider
        self.expected = range(ranks)
        self.launchers = Launchers(self.loop, self._launcher_exited, self._launch_failed)
        self.notes: list[str] = []  # what each host's node keeper had to say (under --hosts), for the job's end
        self.abandoned = False  # the job cannot run: see abandon()
        self.late_signal: int | None = None  # a stopping signal once every rank had ended (see _on_signal)
        self._say = note
        self._server_cue = ServerCue(self.expected, server_after)
        self._nodes_overdue = self._nodes_timer = False
        self._usage_file = usage_file  # under --hosts, for mpsrun top
        self._where: dict[int, tuple[str, int]] = {}  # each started rank's host and pid
        self._remote_peaks: dict[str, int] = {}
        self._publish_due = False
        if early is not None:
            self.launchers.adopt(early)

    def note(self, text: str) -> None:
        self._say(text)

    def result(self, teardown_failure: str = "", late_signal: int | None = None) -> JobResult:
        """How the job ended, as judged here."""
        return self.judging.result(teardown_failure, late_signal)

    def run(self, first: Callable[[], object] | None = None, pending: Sequence[int] = ()) -> None:
        """As every controller runs; then what the MPI launchers had started and left is killed (see
        :meth:`Launchers.kill_leftovers`)."""
        try:
            super().run(first, pending)
        finally:
            self.launchers.kill_leftovers()

    def launch(self, specs: Sequence[LaunchSpec]) -> None:
        """Start the ranks' launchers (unless one was started early)."""
        if not self.launchers.started:
            self.launchers.launch(specs)

    def abandon(self) -> None:
        """The job cannot run (its set-up failed after its MPI launcher had started): every rank supervisor that
        comes is refused quietly with exit 0 (no launcher's banner), the launcher gets --grace (at least
        ABANDON_WAIT, at most what is left of --timeout), then SIGTERM, SIGKILL; a stopping signal kills it."""
        self.abandoned = True
        self.stop(signal.SIGTERM)
        wait = max(self.policy.grace, ABANDON_WAIT)  # SIGTERM while mpiexec starts ranks makes it print a banner
        self.launchers.wind_down(wait if self.policy.timeout is None else min(wait, max(self.policy.timeout, 0.0)))

    # -- the ranks ---------------------------------------------------------------------------------

    def _refusal(self, identity: RankIdentity) -> tuple[int, str] | None:
        if identity.rank not in self.ranks and identity.rank not in self.expected:
            return ExitCode.SETUP, f"rank {identity.rank} is not part of this job (ranks {ranges(self.expected)})"
        if self.abandoned:  # refused quietly: see abandon()
            return ExitCode.OK, ""
        return super()._refusal(identity)

    def rank_started(self, state: RankState, message: Started) -> None:
        super().rank_started(state, message)
        if self._usage_file is not None:
            self._where[state.rank] = (message.host, message.pid)
            self._publish_soon()
        delay = self._server_cue.started(state.rank)
        if delay is not None:
            self.loop.after(delay, self._ask_servers)

    def _ask_servers(self) -> None:
        """Start each server before its first client needs it, unless the job is stopping or over: once every rank
        has ended the daemons may be quitting already."""
        if self.session is None or self.stopping is not None or self.table.ended(self.expected):
            return
        for daemon in self.session.daemons:
            try:
                daemon.start_server(wait=False)
            except DaemonError as exc:  # the watch reports a daemon that died
                log.debug("mpsrun: could not ask for an MPS server: %s", exc)

    def _ended(self, state: RankState, end: RankEnd) -> None:
        super()._ended(state, end)
        if self.table.ended(self.expected):
            self._wind_down()

    def relayed(self, message: Found | Note | Peaks) -> None:
        if isinstance(message, Note):
            self.notes.append(message.text)
        elif isinstance(message, Peaks):
            self._remote_peaks.update(message.peaks)
            self._publish_soon()
        else:
            self._finding(Finding(message.message, message.fatal, code=message.code))

    def _publish_soon(self) -> None:
        """One write for all that changed in this turn of the loop (a thousand ranks start in a few turns)."""
        if not self._publish_due:
            self._publish_due = True
            self.loop.after(0, self._publish_usage)

    def _publish_usage(self) -> None:
        """Under ``--hosts``: where each rank runs and its peak device memory so far, as the hosts' node keepers said,
        in the job's session directory (``mpsrun top`` on this host shows the other hosts' ranks from it)."""
        self._publish_due = False
        if self._usage_file is not None:
            publish(self._usage_file, {str(rank): {"host": host, "pid": pid, "peak": self._remote_peaks.get(str(rank))}
                                       for rank, (host, pid) in sorted(self._where.items())})

    def node_closed(self) -> None:
        if self.table.ended(self.expected):
            self._wind_down()

    def _wind_down(self) -> None:
        """Every rank has ended: the launchers get --grace to exit, once every host's node keeper has closed
        (a keeper's last rank waits for its teardown, and ending the launcher would cut that short)."""
        self._clients_gone()  # the daemons quit while the launchers exit
        if not self.table.nodes:
            self.launchers.wind_down(self.policy.grace)
        elif not self._nodes_timer:
            self._nodes_timer = True
            self.loop.after(NODE_CLOSE_WAIT, self._nodes_late)

    def _lost(self) -> None:
        """Ranks still silent after SIGKILL are given up; a node keeper that relayed no word of them answers no more
        (stopped, or its host is gone): its closing is not waited for either."""
        silent = any(state.link in self.table.nodes for state in self.table.live())
        super()._lost()
        if silent:
            self._nodes_late()

    def _nodes_late(self) -> None:
        self._nodes_overdue = True
        self.launchers.wind_down(self.policy.grace)

    def _done(self) -> bool:
        """Every rank has ended, every launcher has exited, and the hosts' node keepers have closed (or are late)."""
        return self.table.ended(self.expected) and self.launchers.ended and (
            not self.table.nodes or self._nodes_overdue)

    # -- signals and time -------------------------------------------------------------------------

    def _on_signal(self, sig: int) -> None:
        if sig in STOP_SIGNALS and self.table.ended(self.expected) and not self.abandoned:
            # The hosts' node keepers end their sessions within deadlines of their own, as the other paths' teardown
            # does after their loop: noted for the job's end, as a signal while ending the job, and not acted on.
            self.late_signal = self.late_signal or sig
        elif not self.abandoned:
            super()._on_signal(sig)
        elif sig in STOP_SIGNALS:  # the job never ran: whatever still starts its refused ranks goes at once
            self.launchers.kill()

    def _timeout_applies(self) -> bool:
        """Not once every rank has ended: --timeout bounds the job's ranks (and its start), and the job's own
        teardown after them has deadlines of its own (a node keeper whose daemon will not quit made --hosts jobs
        exit 124 where every other path exits 0); nor for a job that never ran (its own error is the one)."""
        return not self.abandoned and not self.table.ended(self.expected)

    # -- launchers --------------------------------------------------------------------------------

    def stop(self, sig: int, restart: bool = False) -> None:
        """Start nothing more: the ranks still to be launched, and those no launcher was ever started for (a job
        that failed before its launch), will never start; then stop the ranks."""
        if self.stopping is None or restart:
            pending = self.launchers.cancel()
            launched = {rank for started in self.launchers.started for rank in started.spec.ranks}
            self._never_started(sorted(set(pending) | {r for r in self.expected
                                                       if r not in launched and r not in self.ranks}))
        super().stop(sig, restart)

    def _kill(self) -> None:
        """An MPI launcher still starting ranks (or hung before them) gets --grace more, then SIGTERM, SIGKILL."""
        super()._kill()
        self.launchers.wind_down(self.policy.grace)

    def kill_now(self) -> None:
        """The ranks and whatever still starts them (a second Ctrl-C)."""
        super().kill_now()
        self.launchers.kill()

    def _launch_failed(self, spec: LaunchSpec, exc: OSError) -> None:
        """A launcher (a rank's supervisor, or mpiexec) could not be started: the job fails, nothing more starts."""
        self.fail("setup", ExitCode.SETUP, f"cannot start rank(s) {ranges(list(spec.ranks))}: {exc}")
        self._never_started([r for r in spec.ranks if r not in self.ranks])

    def _launcher_exited(self, started: Launched, returncode: int) -> None:
        self.judging.judge.launcher_ended(started.spec.name, returncode, started.spec.signal_status)
        if self.table.nodes and any(r not in self.ranks for r in started.spec.ranks):
            # Node keepers relay their ranks' starts: those of ranks that ran may still be on their way.
            self.loop.after(LAUNCHER_REPORT_WAIT, lambda: self._launcher_judged(started, returncode, waited=True))
        else:
            self._launcher_judged(started, returncode, waited=False)

    def _launcher_judged(self, started: Launched, returncode: int, waited: bool) -> None:
        missing = [r for r in started.spec.ranks if r not in self.ranks]
        silent = unheard(started.spec.hosts, self.table.heard)
        if silent and len(missing) == len(started.spec.ranks):  # no rank started: the launcher did not get there
            self.fail("setup", ExitCode.SETUP, f"{started.spec.name} {describe_returncode(returncode)} before any "
                      f"rank started: no node keeper came from {', '.join(silent)}: it could not reach the host or "
                      "start mpsrun there (its own lines say why)")
            self._never_started(missing)
        elif missing:
            self.fail("launcher-failed", returncode, f"{started.spec.name} {describe_returncode(returncode)} "
                      f"before rank(s) {ranges(missing)} started")
            self._never_started(missing)
        elif returncode != 0 and self._running(started):
            self.loop.after(0 if waited else LAUNCHER_REPORT_WAIT, lambda: self._launcher_outlived(started, returncode))

    def _running(self, started: Launched) -> list[RankState]:
        return [self.ranks[r] for r in started.spec.ranks if r in self.ranks and self.ranks[r].end is None]

    def _launcher_outlived(self, started: Launched, returncode: int) -> None:
        """The launcher ended while its ranks ran, and their reports have had time to come: what they said decides
        (a lost rank takes the launcher's status as its own), else the launcher's status does."""
        running = self._running(started)
        if running:
            self.fail("launcher-failed", returncode, f"{started.spec.name} {describe_returncode(returncode)} "
                      f"while rank(s) {ranges([s.rank for s in running])} ran")
