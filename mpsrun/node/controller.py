"""A node keeper's controller: one node's ranks, and the node's end before its last rank's.

The ranks of a per-node job join their node's keeper one by one, as the launcher starts them.
Every node controller keeps the node's session until the last of the ranks the launcher put on the
node has had its verdict: that verdict waits for the node's teardown, and its rank waits (lingers)
until the keeper is gone, so the launcher's end means the node's session is gone too.

A bare ``--per-node`` job's node judges its ranks itself (:class:`~mpsrun.job.judging.Judging`), and the first
failing rank's supervisor prints the summary; under ``mpsrun --hosts`` the node relays them to the job's
controller, which judges (:class:`~mpsrun.node.relay.Relaying`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

from mpsrun.job.controller import Admit, Controller
from mpsrun.job.judging import Judging
from mpsrun.job.outcome import Policy
from mpsrun.job.table import RankState
from mpsrun.node.relay import Relaying
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import IDLE_TIMEOUT, LATE_WAIT
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ProcessRef, pidfd
from mpsrun.runtime.protocol import Link, Listener, Peaks, Say
from mpsrun.session.session import Session

__all__ = ["NodeController", "Starter"]


class Starter(NamedTuple):
    """The rank that started the keeper; the pipe it holds open until it has joined (the keeper's end of it reports
    the rank's end when the rank never joins: interrupted or killed right after the keeper was ready); and the
    process that started that rank, the node's launcher (mpiexec's proxy, srun's step daemon), when known."""

    rank: int
    pipe: int
    launcher: ProcessRef | None = None


class NodeController(Controller):
    """A node keeper's controller. ``expected``: how many ranks the launcher put on this node (None when it does
    not say); ``close``: ends the node's session, returning what to say about it; ``starter``: the rank that started
    the keeper (the controller owns its pipe from now on); ``upstream``: under ``--hosts``, the link to the job's
    controller, which judges (else this node does, and tells the user through its ranks)."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, *, session: Session,
                 expected: int | None, close: Callable[[], list[str]], starter: Starter | None = None,
                 upstream: Link | None = None) -> None:
        super().__init__(listener, token, welcome, policy, session,
                         Judging if upstream is None else functools.partial(Relaying, upstream=upstream))
        self.judging = self.decider if isinstance(self.decider, Judging) else None  # this node is the job's voice
        self._summary_said = False
        self.expected = expected
        self._close_node = close
        self._starter = starter  # None once it has let go of its pipe
        self._absent = 0  # ranks of the node that will never come (a starter gone before it joined)
        self._launcher: int | None = None  # a pidfd of the process that started the node's first rank
        self._launcher_ended = False
        self.give_up = False  # no rank ever came, or the ranks the launcher announced never did

    def run(self, first: Callable[[], object] | None = None, pending: Sequence[int] = ()) -> None:
        self.loop.after(IDLE_TIMEOUT, self._idle)
        if self._starter is not None:
            self.loop.watch(self._starter.pipe, self._starter_left)
            if self._starter.launcher is not None:
                self._watch_launcher(self._starter.launcher)
        super().run(first, pending)

    def _starter_left(self) -> None:
        """The starting rank let go of its pipe: it joined first, or it never will (and no one waits for it)."""
        starter, self._starter = self._starter, None
        assert starter is not None
        self.loop.unwatch(starter.pipe)
        os.close(starter.pipe)
        if starter.rank not in self.ranks:
            self._place_left_empty()

    def _refusal(self, identity: RankIdentity) -> tuple[int, str] | None:
        """A second process that says it is one of the node's ranks took one of the places the launcher announced
        for this node (ranks started by hand with the same local rank), so no other rank comes for it."""
        if self.stopping is None and identity.rank in self.ranks:
            self._place_left_empty()
        return super()._refusal(identity)

    def _place_left_empty(self) -> None:
        """A place the launcher announced for this node will have no rank."""
        self._absent += 1
        if self.ranks and not self._awaited():
            self._late_ranks_overdue()

    def _watch_launcher(self, launcher: ProcessRef) -> None:
        """Watch the launcher of the node's ranks: once it has ended, no rank of this node is still on its way (one
        that failed before it could join, say)."""
        fd = pidfd(launcher.pid)
        if fd is not None and launcher.alive():  # the pidfd is that very process's
            self._launcher = fd
            self.loop.watch(fd, self._launcher_gone)
        elif fd is not None:
            os.close(fd)

    def _launcher_gone(self) -> None:
        assert self._launcher is not None
        self.loop.unwatch(self._launcher)
        os.close(self._launcher)
        self._launcher, self._launcher_ended = None, True
        if not self.ranks:
            self.give_up = True
        elif not self._awaited():
            self._late_ranks_overdue()

    def _awaited(self) -> bool:
        """Whether ranks of this node have yet to come: the starting rank, still on its way, or others the launcher
        put on the node (when it says how many). None once the launcher has ended: no rank comes then."""
        if self._launcher_ended:
            return False
        if self._starter is not None and self._starter.rank not in self.ranks:
            return True
        return len(self.ranks) + self._absent < (self.expected or 0)

    def _idle(self) -> None:
        if not self.ranks:
            self.give_up = True

    def _peaks_grew(self, peaks: dict[int, int]) -> None:
        """Also to the job's controller, under ``--hosts``: ``mpsrun top`` on its host shows this host's ranks."""
        super()._peaks_grew(peaks)
        if isinstance(self.decider, Relaying):
            self.decider.upstream.send(Peaks({str(rank): peak for rank, peak in peaks.items()}))

    def note(self, text: str) -> None:
        """Into keeper.log, and when this node judges, through one of its ranks to the user."""
        say(f"mpsrun keeper: {text}")
        if self.judging is None:
            return
        for state in sorted(self.table.live(), key=lambda s: s.rank):
            if state.link is not None and state.link.send(Say(text)):
                return

    def _done(self) -> bool:
        every = len(self.ranks) + self._absent >= (self.expected or 1) and not self._awaited()
        return self.give_up or (every and all(s.end is not None and s.verdict_sent for s in self.ranks.values()))

    def _verdict_lines(self, state: RankState, lines: list[str]) -> tuple[list[str], bool]:
        """When this node judges, the first failure's summary goes with the first verdict that can still be
        delivered, so exactly one rank's supervisor prints it. The last rank out waits for the node's teardown
        (and, lingering, for the keeper to end)."""
        judge = self.judging.judge if self.judging is not None else None
        if judge is not None and judge.failed and not self._summary_said and state.link is not None \
                and state.link.usable:
            self._summary_said = True
            lines = [judge.message, *lines]
        if not all(s.verdict_sent for s in self.ranks.values()):
            return lines, False
        if self._awaited():  # a rank of the node has yet to come: keep the session a while
            self.loop.after(LATE_WAIT, self._late_ranks_overdue)
            return lines, False
        return lines + self.decider.delivered(self._close()), True

    def _close(self) -> list[str]:
        self.lingering = True  # a rank told its end from now on waits for the keeper to end
        return self._close_node()

    def _late_ranks_overdue(self) -> None:
        if all(s.verdict_sent for s in self.ranks.values()):
            self.decider.delivered(self._close())
            self.give_up = True

    @property
    def reports_failures(self) -> bool:
        """Whether the node's end should say what the MPS logs tell about failed ranks: when the job failed (a relay
        cannot know: it says so always)."""
        return self.judging is None or self.judging.judge.failed
