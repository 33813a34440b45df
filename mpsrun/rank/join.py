"""How a rank's supervisor joins its controller, and how a rank that cannot start says why, once.

The controller is the ``mpsrun`` that launched the job, or the node keeper under ``--per-node``; its
address and the job's token come in the supervisor's environment (:mod:`mpsrun.runtime.constants`).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

from mpsrun.errors import InterruptionError, JoinError, MPSError
from mpsrun.exitcodes import ExitCode, Outcome, exit_code
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import CONTROL_VARIABLE, LINGER_TIMEOUT, TOKEN_VARIABLE, WELCOME_TIMEOUT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.output import say
from mpsrun.runtime.protocol import Admitted, Found, Hello, Link, Refusal, Welcome, connect

__all__ = ["Join", "direct", "greet", "refused", "report_failure", "report_interrupt", "take_output"]

#: Joins a controller with a hello: the link, and the controller's answer (welcome or refusal; None if it went).
Join = Callable[[Hello], "tuple[Link, Welcome | Refusal | None]"]
_TELL_TIMEOUT = 5.0  # a rank that cannot start, telling the job's controller why


def greet(link: Link, hello: Hello) -> Welcome | Refusal | None:
    """Say hello; the controller's welcome or refusal (``retry``: come again), or None if it went away."""
    link.send(hello)
    answer = link.expect((Welcome, Refusal), Deadline(WELCOME_TIMEOUT))
    assert answer is None or isinstance(answer, (Welcome, Refusal))
    return answer


def direct(address: str) -> Join:
    """Join the controller at ``address`` (the launcher's)."""

    def join(hello: Hello) -> tuple[Link, Welcome | Refusal | None]:
        link = connect(address, keep_descriptors=True)
        answer = greet(link, hello)
        take_output(link, answer)
        return link, None if isinstance(answer, Refusal) and answer.retry else answer

    return join


def take_output(link: Link, answer: Welcome | Refusal | None) -> None:
    """The stdout and stderr that came with a welcome (the job's own, or under --hosts the host's) become ours: the
    rank's lines go there whole, not through an MPI launcher's forwarding, which cuts lines of different ranks into
    each other. Descriptors that came otherwise are closed."""
    passed = link.take_descriptors()
    if isinstance(answer, Welcome) and len(passed) == 2:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, ours in zip(passed, (1, 2), strict=True):
            os.dup2(fd, ours)
    for fd in passed:
        os.close(fd)


def report_failure(exc: MPSError, local_rank: int | None) -> None:
    """A rank that cannot start says why once: under ``--hosts`` to the job's controller, which makes it
    the job's one summary line; otherwise the node's first local rank prints it (a :class:`JoinError` says itself
    whether this rank does)."""
    address = os.environ.get(CONTROL_VARIABLE)
    if address and _tell_controller(address, f"error: {exc}", exc.exit_code):
        return
    if exc.speaks if isinstance(exc, JoinError) else local_rank in (0, None):
        say(f"mpsrun: error: {exc}")


def report_interrupt(exc: InterruptionError, local_rank: int | None) -> None:
    """A rank stopped by a signal before the ranks started says so once: under ``--hosts`` to the job's controller
    (which says nothing more when the job had already failed: the launcher signals the ranks of a failed job);
    otherwise the node's first local rank prints it."""
    message = f"{exc} before the ranks started"
    address = os.environ.get(CONTROL_VARIABLE)
    if address and address.startswith("tcp:") and _tell_controller(address, message, exc.exit_code):
        return
    if local_rank in (0, None):
        say(f"mpsrun: {message}")


def _tell_controller(address: str, message: str, code: int) -> bool:
    try:
        link = connect(address)
        link.send(Hello("node", os.environ.get(TOKEN_VARIABLE, ""), node=socket.gethostname()))
        told = link.expect((Admitted,), Deadline(_TELL_TIMEOUT)) is not None and link.send(
            Found(message, True, int(code)))
        link.close()
    except OSError:
        return False
    return told


def refused(link: Link, answer: Refusal | None, identity: RankIdentity) -> int:
    """A rank refused (or left without an answer) ends with its refusal's code. A rank refused because the job is
    already stopping says nothing; a lost controller is said once per node."""
    lost = "the job's controller went away before the ranks started" if identity.local_rank == 0 else ""
    message = lost if answer is None else answer.message
    if message:
        say(f"mpsrun: {message.removeprefix('mpsrun: ')}")
    if answer is not None and answer.linger:  # the node's last rank: wait until its keeper is gone
        link.outlive_peer(Deadline(LINGER_TIMEOUT))
    link.close()
    return exit_code(Outcome("decided", ExitCode.SETUP if answer is None else answer.exit_code))
