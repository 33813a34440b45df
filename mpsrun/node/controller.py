"""A node keeper's controller: one node's ranks, and the node's end before its last rank's.

The ranks of a per-node job join their node's keeper one by one, as the launcher starts them.
Every node controller keeps the node's session until the last of the ranks the launcher put on the
node has had its verdict: that verdict waits for the node's teardown, and its rank waits (lingers)
until the keeper is gone, so the launcher's end means the node's session is gone too.

* :class:`NodeController` (a bare ``--per-node`` job): judges the node's ranks itself, and the first
  failing rank's supervisor prints the summary.
* :class:`~mpsrun.node.relay.RelayController` (under ``mpsrun --hosts``): the job's controller judges.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from mpsrun.job.controller import Admit, Controller, JudgingController
from mpsrun.job.outcome import Policy
from mpsrun.job.table import RankState
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import IDLE_TIMEOUT, LATE_WAIT
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ProcessRef, pidfd
from mpsrun.runtime.protocol import Listener, Say
from mpsrun.session.session import Session

__all__ = ["NodeController", "NodeSide", "Starter"]


class Starter(NamedTuple):
    """The rank that started the keeper; the pipe it holds open until it has joined (the keeper's end of it reports
    the rank's end when the rank never joins: interrupted or killed right after the keeper was ready); and the
    process that started that rank, the node's launcher (mpiexec's proxy, srun's step daemon), when known."""

    rank: int
    pipe: int
    launcher: ProcessRef | None = None


class NodeSide(Controller):
    """What every node keeper's controller does. ``expected``: how many ranks the launcher put on this node (None
    when it does not say); ``close``: ends the node's session, returning what to say about it; ``starter``: the rank
    that started the keeper (the controller owns its pipe from now on)."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, *, session: Session,
                 expected: int | None, close: Callable[[], list[str]], starter: Starter | None = None) -> None:
        super().__init__(listener, token, welcome, policy, session)
        self.expected = expected
        self._close_node = close
        self._closed = False
        self._starter = starter  # None once it has let go of its pipe
        self._absent = 0  # ranks of the node that will never come (a starter gone before it joined)
        self._launcher: int | None = None  # a pidfd of the process that started the node's first rank
        self._launcher_ended = False
        self.give_up = False  # no rank ever came, or the ranks the launcher announced never did

    def _arm(self) -> None:
        super()._arm()
        self.loop.after(IDLE_TIMEOUT, self._idle)
        if self._starter is not None:
            self.loop.watch(self._starter.pipe, self._starter_left)
            if self._starter.launcher is not None:
                self._watch_launcher(self._starter.launcher)

    def _starter_left(self) -> None:
        """The starting rank let go of its pipe: it joined first, or it never will (and no one waits for it)."""
        starter, self._starter = self._starter, None
        assert starter is not None
        self.loop.unwatch(starter.pipe)
        os.close(starter.pipe)
        if starter.rank not in self.ranks:
            self._place_left_empty()

    def _came_twice(self, identity: RankIdentity) -> None:
        """It took one of the places the launcher announced for this node (ranks started by hand with the same
        local rank), so no other rank comes for it."""
        self._place_left_empty()

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

    def note(self, text: str) -> None:
        say(f"mpsrun keeper: {text}")  # into keeper.log

    def _done(self) -> bool:
        every = len(self.ranks) + self._absent >= (self.expected or 1) and not self._awaited()
        return self.give_up or (every and all(s.end is not None and s.verdict_sent for s in self.ranks.values()))

    def _verdict_lines(self, state: RankState, lines: list[str]) -> tuple[list[str], bool]:
        """The last rank out waits for the node's teardown (and, lingering, for the keeper to end)."""
        if not all(s.verdict_sent for s in self.ranks.values()):
            return lines, False
        if self._awaited():  # a rank of the node has yet to come: keep the session a while
            self.loop.after(LATE_WAIT, self._late_ranks_overdue)
            return lines, False
        return lines + self._delivered(self._close()), True

    def _close(self) -> list[str]:
        self._closed = True
        return self._close_node()

    def _lingers(self) -> bool:
        return self._closed

    def _delivered(self, lines: list[str]) -> list[str]:
        """What the node's end has to say, as the last verdict carries it (a relay sends it up instead)."""
        return lines

    def _late_ranks_overdue(self) -> None:
        if all(s.verdict_sent for s in self.ranks.values()):
            self._delivered(self._close())
            self.give_up = True

    @property
    def reports_failures(self) -> bool:
        """Whether the node's end should say what the MPS logs tell about failed ranks."""
        return True


class NodeController(NodeSide, JudgingController):
    """A bare ``--per-node`` job's node: judges its ranks; the first failure's summary goes with the first verdict
    that can still be delivered, so exactly one rank's supervisor prints it."""

    def __init__(self, listener: Listener, token: str, welcome: Admit, policy: Policy, *, session: Session,
                 expected: int | None, close: Callable[[], list[str]], starter: Starter | None = None) -> None:
        super().__init__(listener, token, welcome, policy, session=session, expected=expected, close=close,
                         starter=starter)
        self._summary_said = False

    def note(self, text: str) -> None:
        """Into keeper.log, and through one of the node's ranks to the user."""
        super().note(text)
        for state in sorted(self.table.live(), key=lambda s: s.rank):
            if state.link is not None and state.link.send(Say(text)):
                return

    def _verdict_lines(self, state: RankState, lines: list[str]) -> tuple[list[str], bool]:
        if self.judge.failed and not self._summary_said and state.link is not None and state.link.usable:
            self._summary_said = True
            lines = [self.judge.message, *lines]
        return super()._verdict_lines(state, lines)

    @property
    def reports_failures(self) -> bool:
        return self.judge.failed
