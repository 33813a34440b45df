"""Under ``--hosts``: a host's agent's side of its link to the job's command (the command's side is
:mod:`mpsrun.job.hosts`).

The agent's events go up as messages; the command decides for the whole job and sends each agent its
:class:`~mpsrun.runtime.protocol.Stop`.
"""

from __future__ import annotations

import socket

from mpsrun.agent.decision import InterruptSources
from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.constants import UPSTREAM_TIMEOUT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.protocol import (
    Admitted,
    Ended,
    Found,
    Hello,
    Interrupted,
    Link,
    Note,
    Peaks,
    Started,
    Stop,
    connect,
)

__all__ = ["Upstream", "join_command"]


def join_command(address: str, token: str) -> Link:
    """The link to the job's command, admitted. A command that is not there has ended (a signal as its hosts'
    agents started): said as such, not as the socket's error."""
    try:
        link = connect(address)
    except OSError as exc:
        raise MPSError(f"the job's command has ended ({address} refused this node: {exc.strerror or exc})") from None
    link.send(Hello("node", token, node=socket.gethostname()))
    if link.expect((Admitted,), Deadline(UPSTREAM_TIMEOUT)) is None:
        link.close()
        raise MPSError(f"the job's controller at {address} did not answer")
    return link


class Upstream:
    """Under ``--hosts``: the node's events go up ``link`` to the job's command, which decides. ``job_code``: the
    job's exit code once the command said it; ``orphaned``: the command is gone (the node's ranks then get 3)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.job_code: int | None = None
        self.orphaned = False
        self._interrupts = InterruptSources()
        self._interrupted = False
        self._refusals: set[str] = set()

    def rank_started(self, started: Started) -> None:
        self.link.send(started)

    def rank_ended(self, ended: Ended) -> None:
        self.link.send(ended)

    def refused(self, code: int, message: str) -> str:
        """Said once, by the job's command: it is the job's summary line."""
        if message not in self._refusals:
            self._refusals.add(message)
            self.link.send(Found(message.removeprefix("mpsrun: "), True, code))  # "error: ...", as the job says
        return ""

    def failed(self, code: int, message: str) -> None:
        self.link.send(Found(message, True, code))

    def warned(self, message: str) -> None:
        self.link.send(Found(message, False))

    def interrupted(self, sig: int, source: int) -> None:
        if self._interrupts.news(sig, source, self._interrupted):
            self._interrupted = True
            self.link.send(Interrupted(sig))

    def verdict(self, own: int, deliverable: bool) -> tuple[int, list[str]]:
        return ExitCode.SETUP if self.orphaned else own if self.job_code is None else self.job_code, []

    def closing(self, lines: list[str]) -> list[str]:
        """The node's last words go up to the job's command, which says them at the job's end."""
        for line in lines:
            self.link.send(Note(line))
        return []

    def peaks(self, peaks: dict[int, int]) -> None:
        self.link.send(Peaks({str(rank): peak for rank, peak in peaks.items()}))

    def ordered(self, stop: Stop | None) -> None:
        """The command's stop (None: the command is gone)."""
        if stop is None:
            self.orphaned = True
        elif stop.exit_code is not None:
            self.job_code = stop.exit_code
