"""The node keeper: a ``--per-node`` job's agent, as a process of its own on each node (each host under ``--hosts``).

The node's first local rank (:mod:`mpsrun.agent.pernode`) starts it in a new interpreter, then reserves the node
session's directory for it, then sends its :class:`KeeperRequest` on stdin (a keeper whose request never comes drops
that reservation). It forks into the background, claims the directory and listens in it, so the node's other ranks
connect and wait; it starts the session and answers the starting rank on stdout (an encoded :class:`Admitted`, or the
:class:`Refusal` that says why it cannot). It runs in its own session with its output in the session directory, so it
never holds the launcher's output pipes open.

Every local rank's supervisor joins it, however late; when the last of the ranks the launcher put on the node has had
its verdict, the keeper ends the session first, and the node's ranks wait (linger) until the keeper is gone, so the
launcher's end means the node is clean. A bare ``--per-node`` job's node decides for itself (a
:class:`~mpsrun.agent.decision.Decision`) and speaks through its ranks; under ``--hosts`` it reports to the job's
command, which decides (:class:`Upstream`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from mpsrun.agent.account import Report, accounted, report_path, to_say
from mpsrun.agent.agent import Agent, Top, Welcoming
from mpsrun.agent.arrivals import Arrivals
from mpsrun.agent.decision import Decision
from mpsrun.agent.findings import mps_report, verified_line
from mpsrun.agent.outcome import Policy
from mpsrun.agent.pernode import KeeperRequest
from mpsrun.agent.ranks import turn_away
from mpsrun.agent.uplink import Upstream, join_command
from mpsrun.agent.welcome import free_port, rendezvous
from mpsrun.config.options import JobConfig
from mpsrun.errors import InterruptionError, LockHeldError, MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.constants import (
    FORWARDED_SIGNALS,
    LINGER_TIMEOUT,
    LOCK_TIMEOUT,
    PASS_SIGNALS,
)
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ProcessRef, ensure_descriptors, exit_now
from mpsrun.runtime.protocol import (
    Admitted,
    Link,
    Listener,
    Refusal,
    Stop,
    encode,
)
from mpsrun.session import leftovers
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import user_root_lock
from mpsrun.session.reservation import drop_reservation

__all__ = ["Keeper", "failure_answer", "main", "turn_away_locked"]

log = logging.getLogger("mpsrun")


def failure_answer(exc: BaseException) -> tuple[int, str]:
    """A keeper that cannot start: its exit code and the node's one line about it."""
    if isinstance(exc, InterruptionError):  # the node's ranks end as a signalled rank does
        return exc.exit_code, f"this node's keeper was {exc} while its session started"
    if isinstance(exc, MPSError):
        return exc.exit_code, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.SETUP, "this node's keeper was interrupted while its session started"
    if isinstance(exc, OSError):  # (no room, no inode left)
        where = f": {exc.filename}" if exc.filename else ""
        return ExitCode.SETUP, f"this node's keeper could not start its session: {exc.strerror or exc}{where}"
    return ExitCode.SETUP, f"node keeper failed: {exc!r}"


def turn_away_locked(listener: Listener, base: Path, refusal: Refusal, wait: float = LOCK_TIMEOUT) -> None:
    """:func:`~mpsrun.agent.ranks.turn_away` under the user's lock, where ranks connect, so none comes between (a
    rank that meets a closed connection knows we died). Where another process holds that lock past ``wait`` (what a
    rank can do), without it, said: a rank that connects just then takes us for dead."""
    try:
        with user_root_lock(base, wait):
            turn_away(listener, refusal)
            return
    except LockHeldError as exc:  # (its words name the wait, 0 s where the job's deadline had passed)
        log.warning("mpsrun: another process of yours held the lock on %s: this node's ranks were turned away "
                    "without it", exc.path)
    turn_away(listener, refusal)


class Keeper:
    """A node's agent, the ranks it awaits, and who decides for it: the job's command above (``link``, under
    --hosts) or the node itself. Made by :meth:`open`."""

    def __init__(self, request: KeeperRequest, config: JobConfig, claim: SessionClaim, listener: Listener,
                 link: Link | None, starter_pipe: int) -> None:
        self.request, self.config = request, config
        self.closed = False
        self.began = time.time()  # what MPI leaves on the node since then is the job's (mpsrun.session.leftovers)
        self.loop = loop = EventLoop()
        self.deadline = deadline = Deadline(config.timeout, since=request.started)  # (from the starting rank's start)
        self.upstream = Upstream(link) if link is not None else None
        self.decision = None if link is not None else Decision(loop, stop=self._stop, kill=self._kill, say=self.note,
                                                               summary=True)
        top: Top = self.upstream if self.upstream is not None else self.decision  # type: ignore[assignment]
        one_node = rendezvous("127.0.0.1", free_port(), os.environ)  # for a job of this node only
        welcoming = Welcoming(settings=json.dumps(config.settings(), sort_keys=True), devices=request.devices,
                              extra=one_node, notices=True, output=request.output)
        self.agent = Agent(config, loop, top, claim, listener, request.name, deadline, welcoming=welcoming,
                           local_size=request.local_size, world_size=request.world_size, closing=self.closing,
                           awaited=lambda: self.arrivals.awaited())
        launcher = ProcessRef(*request.launcher) if request.launcher else None
        self.arrivals = Arrivals(loop, self.agent, request.local_size, request.starter, starter_pipe, launcher)

    @classmethod
    def open(cls, request: KeeperRequest, starter_pipe: int, abandoned: threading.Event) -> Keeper:
        """Claim the node session's reserved directory and listen in it (the node's other ranks connect and wait);
        under --hosts join the job's command; start the session (bounded by --timeout). ``abandoned``: set once the
        rank that started us has left (we are then stopped): the ranks that wait come again, to a keeper of their
        own, as nothing failed that another keeper would meet."""
        config = JobConfig.from_json(request.config)
        ensure_descriptors(request.local_size or 1)
        claim = SessionClaim.make(Path(request.base), "node", request.name, config.keep_logs,
                                  reservation=request.reservation)
        assert claim.dirs is not None
        try:
            listener = Listener(f"unix:{claim.dirs.control_socket}")  # the node's other ranks connect and wait
        except BaseException:
            claim.release()
            raise
        keeper = link = None
        try:
            link = join_command(request.upstream, request.token) if request.upstream else None
            keeper = cls(request, config, claim, listener, link, starter_pipe)
            keeper.agent.start()
        except BaseException as exc:  # the node's ranks that wait hear why, and start no keeper of their own
            code, why = failure_answer(exc)  # heard: whether the rank that started us gets it too
            turn_away_locked(listener, Path(request.base), Refusal(retry=True) if abandoned.is_set()
                             else Refusal(code, why, failed=True, heard=_starter_listens()))
            if keeper is not None:
                with contextlib.suppress(MPSError):
                    keeper.agent.close()
            else:
                if link is not None:
                    link.close()
                claim.release()
            raise
        return keeper

    def _stop(self, sig: int, again: bool) -> None:
        self.agent.stop(sig, again)

    def _kill(self) -> None:
        self.agent.signal(signal.SIGKILL)

    def note(self, text: str) -> None:
        """Into keeper.log, and through one of the node's ranks to the user."""
        say(f"mpsrun keeper: {text}")
        self.agent.say(text)

    def run(self) -> None:
        if self.upstream is not None:
            self.loop.watch(self.upstream.link.fd, self._orders)
            if self.upstream.link.held:  # what came with our admission: the job's stop, as we joined
                self.loop.after(0, self._orders)
        if self.decision is not None:
            policy = Policy.for_job(self.config, self.deadline)
            self.decision.arm(policy.timeout, policy.timeout_total)
        self.agent.run_in()
        try:
            with self.loop.signals(FORWARDED_SIGNALS, self._signalled):
                self.loop.run_until(self._done)
        finally:
            self.loop.close()
            if not self.closed:
                self._close()
            self._after_the_launcher()

    def _signalled(self, sig: int) -> None:
        if sig in PASS_SIGNALS:
            self.agent.signal(sig)
        elif self.decision is not None:
            self.decision.signalled(sig)
        else:
            assert self.upstream is not None
            self.upstream.interrupted(sig, 0)

    def _orders(self) -> None:
        assert self.upstream is not None
        messages = self.upstream.link.receive()
        if messages is None:  # the job's command is gone: the node stops its ranks on its own (exit 3)
            self.loop.unwatch(self.upstream.link.fd)  # before the close: see Link
            self.upstream.link.close()
            self.upstream.ordered(None)
            self.agent.stop(signal.SIGTERM)
            return
        for message in messages:
            if isinstance(message, Stop):
                self.upstream.ordered(message)
                if message.signal == signal.SIGKILL:
                    self.agent.signal(signal.SIGKILL)
                else:
                    self.agent.stop(message.signal, restart=True)

    def _done(self) -> bool:
        if self.arrivals.give_up:
            return True
        if self.arrivals.awaited() or not self.agent.settled():
            return False
        if not self.closed:  # the ranks' verdicts went out while others were awaited, and none came
            self.agent.top.closing(self._close())
        return True

    def closing(self) -> list[str] | None:
        """The node's last rank is out: unless ranks are still awaited (None), end the node's session; what to say
        of the node's end."""
        if self.arrivals.awaited():
            self.arrivals.wait_late()
            return None
        return self._close()

    def _close(self) -> list[str]:
        self.closed = True
        agent = self.agent
        agent.doorway.close_door()
        lines = self._closing_lines()
        warnings = logging.handlers.BufferingHandler(1 << 10)  # (a hanging quit, logs kept): our stderr is a log
        warnings.setLevel(logging.WARNING)  # file, so the node's last rank says them
        log.addHandler(warnings)
        try:
            # Come again, to a new keeper (not past the job's deadline: the lock may be held by what a rank left).
            turn_away_locked(agent.listener, Path(self.request.base), Refusal(retry=True),
                             self.deadline.cap(LOCK_TIMEOUT))
            # A late rank finds no socket and a live owner: it waits for the directory to go, then starts a keeper.
            agent.close()
        except MPSError as exc:
            lines.append(str(exc))
        finally:
            log.removeHandler(warnings)
        return lines + [record.getMessage().removeprefix("mpsrun: ") for record in warnings.buffer]

    def _closing_lines(self) -> list[str]:
        agent, decision, host = self.agent, self.decision, socket.gethostname()
        lines: list[str] = []
        agent.settle_watch()
        if agent.watch is not None and self.config.verbose:
            lines.append(verified_line(agent.watch, agent.ranks, f"node {host}: "))
        failed = decision is None or decision.judge.failed  # a relay cannot know: it says so always
        if failed and agent.session.enabled and any(s.end and s.end.returncode != 0 for s in agent.ranks.values()):
            lines += mps_report(agent.session.daemons, {s.process.pid: s.rank for s in agent.ranks.values()
                                                        if s.process is not None})
        if decision is not None and accounted(self.config):  # a bare --per-node node: its accounts are said here
            judge = decision.judge
            accounts = agent.accounts(judge.first.rank if judge.first is not None else None)
            table, hints = to_say(accounts, self.config)
            lines += [f"node {host}: {line}" for line in table] + hints
            if self.config.report:
                report = Report.of(self.config.command, (judge.exit_code(), judge.cause, judge.message), self.began,
                                   accounts, agent.usage, agent.policy.usage_interval)
                if unwritten := report.save(report_path(self.config.report, per_host=True)):
                    lines.append(unwritten)
        return lines

    def _after_the_launcher(self) -> None:
        """What MPI left on this node, removed; after an abort (a rank lost with its supervisor: MPI_Abort ends every
        process of the job) also what only the node's launcher held (Hydra's proxy holds its topology file until it
        exits, and does not remove it when killed), once the launcher is gone (within LINGER_TIMEOUT)."""
        _, held = leftovers.sweep(self.began)
        launcher = ProcessRef(*self.request.launcher) if self.request.launcher else None
        lost = any(s.end is not None and s.end.returncode is None for s in self.agent.ranks.values())
        if launcher is None or not lost or not any(pids == {launcher.pid} for pids in held.values()):
            return
        self.agent.let_go()  # a rank that lingers for our end need not wait for this
        poll_until(lambda: (not launcher.alive()) or None, Deadline(LINGER_TIMEOUT))  # not our child: polled
        leftovers.sweep(self.began)


def _detach(log_dir: Path) -> None:
    """Leave the starting rank's pipes: our output goes to the session directory from now on."""
    try:
        target = os.open(log_dir / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:  # (no room for it): the node's job runs on without the keeper's log (it died, in silence)
        target = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)


def _starter_listens(wait: float = 0.0) -> bool:
    """Whether the rank that started us still reads our answer (the reading end of our stdout is open), looking for
    up to ``wait`` seconds."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLERR)  # on a pipe's writing end: no reader any more
    return not poller.poll(int(wait * 1000))


def _abandon_when_alone(started: threading.Event, abandoned: threading.Event) -> None:
    """The rank waiting for our answer is gone (interrupted, killed: the reading end of our stdout closed)
    before we are ready: stop starting, as if told to."""
    while not started.is_set():
        # Ready is said only after `started` is set, so a reader gone before then was not answered.
        if not _starter_listens(0.1) and not started.is_set():
            abandoned.set()
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _answer(message: Admitted | Refusal) -> None:
    sys.stdout.buffer.write(encode(message))
    sys.stdout.flush()


def _open(request: KeeperRequest, starter_pipe: int) -> Keeper | int:
    """The keeper, started; or, when it cannot start, its exit code once the starting rank has heard why (and the
    directory reserved for it dropped, if it failed before its claim: its rank may be gone)."""
    started, abandoned = threading.Event(), threading.Event()
    try:
        with Interrupts():  # a stopping signal while the session starts: undo it, say why, exit
            # (its SIGTERM is sent only now: the default action would end us with the reservation left)
            threading.Thread(target=_abandon_when_alone, args=(started, abandoned), daemon=True).start()
            keeper = Keeper.open(request, starter_pipe, abandoned)
    except Exception as exc:  # the starting rank must hear why, whatever it was
        started.set()
        with user_root_lock(Path(request.base)):
            drop_reservation(Path(request.base), request.name, request.reservation)
        code, why = failure_answer(exc)
        with contextlib.suppress(OSError):  # the starting rank may be gone
            _answer(Refusal(code, why, failed=True))
        return code
    started.set()
    return keeper


def main(argv: list[str]) -> int:
    """``BASE NAME TOKEN``: the node session's directory, reserved with TOKEN once we were started; the request
    comes on stdin."""
    base, name, token = Path(argv[0]), argv[1], argv[2]
    try:
        request = KeeperRequest.from_json(json.loads(sys.stdin.read()))
    except (ValueError, TypeError):  # none, or cut: the rank that started us was killed before it sent it whole
        with user_root_lock(base):
            drop_reservation(base, name, token)
        return ExitCode.SETUP
    if os.fork() > 0:
        exit_now(ExitCode.OK)  # the starting rank waits for this; the keeper lives on in the background
    # The starting rank holds our stdout's pipe until it has joined: a copy, kept when our output leaves that pipe,
    # tells the keeper if it went (interrupted, killed) before it could.
    keeper = _open(request, os.dup(sys.stdout.fileno()))
    if isinstance(keeper, int):
        return keeper
    try:
        _answer(Admitted())
    except OSError:  # the rank that started us is gone (interrupted): nobody will come
        keeper.agent.close()
        return ExitCode.SETUP
    _detach(keeper.agent.dirs.root)
    keeper.run()
    return ExitCode.OK


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # the node's last rank waits for this process to end
