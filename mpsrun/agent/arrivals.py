"""Which of the ranks the launcher put on a node have yet to come to its keeper (:mod:`mpsrun.agent.keeper`): the
keeper keeps the node's session while they may, and ends it once none will."""

from __future__ import annotations

import os

from mpsrun.agent.agent import Agent
from mpsrun.runtime.constants import IDLE_TIMEOUT, LATE_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.processes import ProcessRef, pidfd

__all__ = ["Arrivals"]


class Arrivals:
    """Which of the ranks the launcher put on this node have yet to come: the rank that started the keeper (its
    ``pipe`` closes once it has joined, or when it never will), others the launcher announced (``expected``), none
    once the node's ``launcher`` has ended."""

    def __init__(self, loop: EventLoop, agent: Agent, expected: int | None, starter: int | None, pipe: int,
                 launcher: ProcessRef | None) -> None:
        self.loop, self.agent, self.expected, self.starter = loop, agent, expected, starter
        self.absent = 0  # places that will have no rank (a starter gone before it joined)
        self.give_up = False  # no rank ever came, or the launcher ended before any did
        self.launcher_ended = False
        self._late: Deadline | None = None  # how long ranks still on their way are waited for
        loop.watch(pipe, lambda: self._starter_left(pipe))
        loop.after(IDLE_TIMEOUT, self._idle)
        self._launcher = pidfd(launcher.pid) if launcher is not None else None
        if self._launcher is not None and launcher is not None and not launcher.alive():  # not that very process's
            os.close(self._launcher)
            self._launcher = None
        if self._launcher is not None:
            loop.watch(self._launcher, self._launcher_gone)

    def awaited(self) -> bool:
        """Whether ranks of this node have yet to come (for LATE_WAIT at most once every rank here is done)."""
        if self.launcher_ended or (self._late is not None and self._late.expired()):
            return False
        if self.starter is not None and self.starter not in self.agent.ranks:
            return True
        return len(self.agent.ranks) + self.absent + self.agent.duplicates < (self.expected or 1)

    def wait_late(self) -> None:
        """Every rank here is done, but others are awaited: keep the session LATE_WAIT for them."""
        if self._late is None:
            self._late = Deadline(LATE_WAIT)
            self.loop.after(LATE_WAIT, lambda: None)  # (the loop looks again then)

    def _starter_left(self, pipe: int) -> None:
        """The starting rank let go of its pipe: it joined first, or it never will (and no one waits for it)."""
        self.loop.unwatch(pipe)
        os.close(pipe)
        if self.starter is not None and self.starter not in self.agent.ranks:
            self.absent += 1
        self.starter = None

    def _launcher_gone(self) -> None:
        assert self._launcher is not None
        self.loop.unwatch(self._launcher)
        os.close(self._launcher)
        self._launcher, self.launcher_ended = None, True
        self.give_up = self.give_up or not self.agent.ranks

    def _idle(self) -> None:
        self.give_up = self.give_up or not self.agent.ranks
