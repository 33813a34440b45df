"""The node keeper: ``mpsrun.node.keeper.main``, run in a new interpreter by the first local rank of a per-node job.

It owns the node's MPS session (daemons, record, reaper) and a controller over the node's ranks
(:mod:`mpsrun.node.controller`, or :mod:`mpsrun.node.relay` under ``--hosts``). Every local rank's
supervisor joins it; it watches them through their connections, so it notices a rank however it
ended (SIGKILL, ``MPI_Abort``, a killed ``mpiexec`` or ``srun``). When the last one is gone it stops
the daemons and removes the session (lock and all) before that last rank may exit. It runs in its
own session with its output in the session directory, so it never holds the launcher's output
pipes open.

It reads its :class:`KeeperRequest` (the node session's name, the job's configuration as data, and
the job's controller under ``--hosts``) as JSON on stdin, forks into the background, and answers
``ready`` or ``<exit code> <why>`` on stdout. Its session's directory was reserved by the starting
rank; it listens there before its daemons start, so the node's other ranks connect and wait.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mpsrun.config.options import JobConfig, differing_options
from mpsrun.config.values import check_shares
from mpsrun.errors import ConfigError, InterruptionError, MPSError
from mpsrun.exitcodes import ExitCode
from mpsrun.job.account import Report, accounted, report_path, to_say
from mpsrun.job.channel import free_port, rendezvous
from mpsrun.job.nodesession import NodeSession
from mpsrun.job.outcome import Judge
from mpsrun.job.placement import Admission
from mpsrun.job.report import mps_report, verified_line
from mpsrun.job.table import refuse_newcomer
from mpsrun.node.controller import NodeController, Starter
from mpsrun.node.pernode import KeeperRequest
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import LINGER_TIMEOUT, UPSTREAM_TIMEOUT
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.processes import ProcessRef, ensure_descriptors, exit_now
from mpsrun.runtime.protocol import Admitted, Hello, Link, Listener, Refusal, connect
from mpsrun.session import leftovers
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import user_root_lock

__all__ = ["NodeKeeper", "failure_answer", "main", "turn_away"]

def _start_session(config: JobConfig, request: KeeperRequest, deadline: Deadline,
                   claim: SessionClaim) -> NodeSession:
    """The node's MPS session, planned for the node's ranks and started in ``claim``."""
    check_shares(config.thread_percentage, request.world_size)  # before anything starts: said once, by the node
    local = NodeSession(config, deadline)
    local.plan(request.local_size)
    local.start("this node's", claim)
    return local


def failure_answer(exc: BaseException) -> tuple[int, str]:
    """A keeper that cannot start: its exit code and the node's one line about it."""
    if isinstance(exc, InterruptionError):  # the node's ranks end as a signalled rank does
        return exc.exit_code, f"this node's keeper was {exc} while its session started"
    if isinstance(exc, MPSError):
        return exc.exit_code, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.SETUP, "this node's keeper was interrupted while its session started"
    return ExitCode.SETUP, f"node keeper failed: {exc!r}"


def turn_away(listener: Listener, base: Path, refusal: Refusal) -> None:
    """Answer every rank still waiting in the listener's backlog with ``refusal``, then close it; under the user's
    lock, where ranks connect, so none comes between (a rank that meets a closed connection knows we died)."""
    with user_root_lock(base):
        listener.sock.setblocking(False)
        while (link := listener.accept()) is not None:
            refuse_newcomer(link, refusal)
        listener.close()


def _upstream(request: KeeperRequest) -> Link:
    """The link to the job's controller (under --hosts), welcomed."""
    link = connect(str(request.upstream))
    link.send(Hello("node", request.token, node=socket.gethostname()))
    if link.expect((Admitted,), Deadline(UPSTREAM_TIMEOUT)) is None:
        link.close()
        raise MPSError(f"the job's controller at {request.upstream} did not answer")
    return link


class NodeKeeper:
    """A node's started session and the controller over its ranks. Make one with :meth:`open`."""

    def __init__(self, config: JobConfig, request: KeeperRequest, local: NodeSession, listener: Listener,
                 upstream: Link | None, starter: Starter | None) -> None:
        self.config, self.request, self.local = config, request, local
        self.session = session = local.session
        self.closed = False
        self.began = time.time()  # what MPI leaves on the node since then is the job's (mpsrun.session.leftovers)
        self._notices = [] if config.quiet else local.without_mps()
        self._rendezvous = rendezvous("127.0.0.1", free_port(), os.environ)  # for a job of this node only
        self.listener = listener
        self.controller = NodeController(listener, request.name, self._welcome, local.policy(), session=session,
                                         expected=request.local_size, close=self.close, starter=starter,
                                         upstream=upstream)

    @classmethod
    def open(cls, config: JobConfig, request: KeeperRequest, starter_pipe: int) -> NodeKeeper:
        """Claim the node session's reserved directory and listen in it (the node's other ranks connect and wait);
        start the session (bounded by --timeout) and, under --hosts, join the job's controller. ``starter_pipe``:
        the starting rank's pipe, which the keeper's controller owns once it is built."""
        deadline = Deadline(config.timeout)
        ensure_descriptors(request.local_size or 1)
        claim = SessionClaim.make(Path(request.base), "node", request.name, config.keep_logs, reserved=True)
        session = listener = None
        try:
            assert claim.dirs is not None
            listener = Listener(f"unix:{claim.dirs.control_socket}")
            local = _start_session(config, request, deadline, claim)
            session = local.session
            upstream = _upstream(request) if request.upstream else None
            launcher = ProcessRef(*request.launcher) if request.launcher else None
            starter = Starter(request.starter, starter_pipe, launcher) if request.starter is not None else None
            return cls(config, request, local, listener, upstream, starter)
        except BaseException as exc:
            if listener is not None:  # the node's ranks that wait hear why, and start no keeper of their own
                code, why = failure_answer(exc)  # heard: whether the rank that started us gets it too
                turn_away(listener, Path(request.base), Refusal(code, why, failed=True, heard=_starter_listens()))
            with contextlib.suppress(MPSError):
                session.close() if session is not None else claim.release()
            raise

    def _welcome(self, identity: RankIdentity, hello: Hello) -> Admission:
        if hello.settings != self.config.settings():
            differ = differing_options(self.config.settings(), hello.settings or {})
            raise ConfigError(f"rank {identity.rank} was started with other mpsrun options than the rank that started "
                              f"this node's session ({', '.join(differ)}); every rank of a per-node job needs the same",
                              setting="options")
        if hello.devices != self.request.devices:
            raise ConfigError("the ranks on this node see different GPUs (CUDA_VISIBLE_DEVICES "
                              f"{hello.devices!r}, not {self.request.devices!r}); mpsrun --per-node needs "
                              "every local rank to see the node's GPUs (no per-task GPU binding)", setting="gpus")
        admission = self.local.admit(identity)
        env = admission.welcome.env
        if identity.world_size == self.request.local_size:  # one node: rank 0 is here, and so is the port
            env = {**env, **self._rendezvous}
        lines, self._notices = self._notices, []  # said once, by the first rank to join
        return admission._replace(welcome=admission.welcome._replace(env=env, lines=lines))

    def close(self) -> list[str]:
        """The last rank is out: stop the daemons, remove the session; what to tell about the node's end."""
        if self.closed:
            return []
        self.closed = True
        self.controller.table.stop_accepting()
        lines = self._closing_lines()
        turn_away(self.listener, Path(self.request.base), Refusal(retry=True))  # come again, to a new keeper
        # A late rank finds no socket and a live owner: it waits for the directory to go, then starts a keeper.
        with _warnings_into(lines):  # (a hanging quit, logs kept): our stderr is a log file; a launcher prints its own
            try:
                self.session.close()
            except MPSError as exc:
                lines.append(str(exc))
        return lines

    def _closing_lines(self) -> list[str]:
        controller = self.controller
        lines: list[str] = []
        if controller.watch is not None and self.config.verbose:
            controller.settle_watch()
            lines.append(verified_line(controller.watch, controller.ranks, f"node {socket.gethostname()}: "))
        ranks = controller.ranks.values()
        if controller.reports_failures and self.session.enabled and any(s.end and s.end.returncode != 0
                                                                        for s in ranks):
            lines += mps_report(self.session.daemons, {s.process.pid: s.rank for s in ranks if s.process is not None})
        if controller.judging is not None:  # a bare --per-node node: its ranks' accounts are said here
            lines += self._accounts(controller.judging.judge)
        return lines

    def _accounts(self, judge: Judge) -> list[str]:
        """The node's ranks' accounts: a table with -v, the memory hint, and ``--report`` (FILE.HOST.json)."""
        config, controller = self.config, self.controller
        if not accounted(config):
            return []
        accounts = controller.accounts(judge.first.rank if judge.first is not None else None)
        table, hints = to_say(accounts, config)
        lines = [f"node {socket.gethostname()}: {line}" for line in table] + hints
        if config.report:
            report = Report.of(config.command, (judge.exit_code(), judge.cause, judge.message), self.began, accounts,
                               controller.usage, controller.policy.usage_interval)
            if unwritten := report.save(report_path(config.report, per_host=True)):
                lines.append(unwritten)
        return lines

    def run(self) -> None:
        try:
            self.controller.run()
        finally:
            self.close()
            self._after_the_launcher()

    def _after_the_launcher(self) -> None:
        """What MPI left on this node, removed; after an abort (a rank lost with its supervisor: MPI_Abort ends every
        process of the job) also what only the node's launcher held (Hydra's proxy holds its topology file until it
        exits, and does not remove it when killed), once the launcher is gone (within LINGER_TIMEOUT)."""
        _, held = leftovers.sweep(self.began)
        launcher = ProcessRef(*self.request.launcher) if self.request.launcher else None
        lost = any(s.end is not None and s.end.returncode is None for s in self.controller.ranks.values())
        if launcher is None or not lost or not any(pids == {launcher.pid} for pids in held.values()):
            return
        for state in self.controller.ranks.values():  # a rank that lingers for our end need not wait for this
            if state.link is not None:
                state.link.close()
        poll_until(lambda: (not launcher.alive()) or None, Deadline(LINGER_TIMEOUT))  # not our child: polled
        leftovers.sweep(self.began)


class _Collector(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().removeprefix("mpsrun: "))


@contextlib.contextmanager
def _warnings_into(lines: list[str]) -> Iterator[None]:
    """The warnings mpsrun logs meanwhile, appended to ``lines`` (which the node's last rank says)."""
    logger = logging.getLogger("mpsrun")
    collector = _Collector(lines)
    logger.addHandler(collector)
    try:
        yield
    finally:
        logger.removeHandler(collector)


def _detach(log_dir: Path | None) -> None:
    """Leave the starting rank's pipes: our output goes to the session directory from now on."""
    target = os.open(log_dir / "keeper.log" if log_dir else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
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


def _abandon_when_alone(started: threading.Event) -> None:
    """The rank waiting for our answer is gone (interrupted, killed: the reading end of our stdout closed)
    before we are ready: stop starting, as if told to."""
    while not started.is_set():
        # Ready is said only after `started` is set, so a reader gone before then was not answered.
        if not _starter_listens(0.1) and not started.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _open(request: KeeperRequest, starter_pipe: int) -> NodeKeeper | int:
    """The keeper, started; or, when it cannot start, its exit code once the starting rank has heard why."""
    started = threading.Event()
    threading.Thread(target=_abandon_when_alone, args=(started,), daemon=True).start()
    try:
        with Interrupts():  # a stopping signal while the session starts: undo it, say why, exit
            keeper = NodeKeeper.open(JobConfig.from_json(request.config), request, starter_pipe)
    except Exception as exc:  # the starting rank must hear why, whatever it was
        started.set()
        code, why = failure_answer(exc)
        with contextlib.suppress(OSError):  # the starting rank may be gone
            print(f"{code} {why}", flush=True)
        return code
    started.set()
    return keeper


def main(argv: list[str] | None = None) -> int:  # (no arguments: the request comes on stdin)
    request = KeeperRequest.from_json(json.loads(sys.stdin.read()))
    if os.fork() > 0:
        exit_now(ExitCode.OK)  # the starting rank waits for this; the keeper lives on in the background
    # The starting rank holds our stdout's pipe until it has joined: a copy, kept when our output leaves that pipe,
    # tells the controller if it went (interrupted, killed) before it could.
    keeper = _open(request, os.dup(sys.stdout.fileno()))
    if isinstance(keeper, int):
        return keeper
    try:
        print("ready", flush=True)
    except OSError:  # the rank that started us is gone (interrupted): nobody will come
        keeper.session.close()
        return ExitCode.SETUP
    _detach(keeper.session.dirs.root if keeper.session.dirs else None)
    keeper.run()
    return ExitCode.OK


if __name__ == "__main__":
    exit_now(main())  # the node's last rank waits for this process to end
