"""The node keeper: ``python -m mpsrun.node.keeper``, started by the first local rank of a per-node job.

It owns the node's MPS session (daemons, record, reaper) and a controller over the node's
ranks. Every local rank's supervisor joins it; it watches them through their connections,
so it notices a rank however it ended (SIGKILL, ``MPI_Abort``, a killed ``mpiexec`` or
``srun``). When the last one is gone it stops the daemons and removes the session (lock
and all) before that last rank may exit. It runs in its own session with its output in the
session directory, so it never holds the launcher's output pipes open.

It reads its request (session name, options, and the job's controller under ``--hosts``)
as JSON on stdin, forks into the background, and answers ``ready`` or ``<exit code> <why>``
on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpsrun.config.options import JobConfig, parse_options
from mpsrun.errors import ConfigError, DaemonTimeoutError, JobTimeoutError, MPSError
from mpsrun.job.controller import Controller, Policy
from mpsrun.job.placement import welcome, without_mps
from mpsrun.job.report import mps_report, verified_line
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import exit_now
from mpsrun.runtime.protocol import Link, Listener, connect
from mpsrun.session.paths import user_root_lock
from mpsrun.session.session import START_TIMEOUT, Session

__all__ = ["NodeKeeper", "main"]

IDLE_TIMEOUT = 60.0  # no rank joined this long after the start: give up


class NodeKeeper:
    def __init__(self, config: JobConfig, request: Mapping[str, Any]) -> None:
        self.config = config
        self.name = str(request["name"])
        self.base = Path(request["base"])
        self.settings = " ".join(request["argv"])
        self.devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.upstream_address = request.get("upstream")
        self.upstream_token = str(request.get("token") or "")
        self.closed = False

    def start(self) -> None:
        config = self.config
        deadline = Deadline(config.timeout)  # --timeout bounds the node's start-up too
        self.session = Session(gpus=list(config.gpus) if config.gpus is not None else "all",
                               thread_percentage=config.thread_percentage
                               if isinstance(config.thread_percentage, int) else None,
                               mem_limit=None if config.mem_limit == "auto" else config.mem_limit, mps=config.mps,
                               keep_logs=config.keep_logs, export=False, quiet=True, gpu_bind=config.gpu_bind,
                               start_timeout=max(0.1, deadline.cap(START_TIMEOUT)))
        try:
            self.session.start(kind="node", name=self.name)
        except DaemonTimeoutError as exc:
            if deadline.expired():
                raise JobTimeoutError(f"timed out after {config.timeout:g} s while this node's MPS daemons started "
                                      f"({exc})", timeout=config.timeout or 0.0) from None
            raise
        reason = self.session.disabled_reason
        self.notices = without_mps(config, reason) if reason is not None and not config.quiet else []
        assert self.session.dirs is not None
        self.listener = Listener(f"unix:{self.session.dirs.control_socket}")
        upstream = self._upstream() if self.upstream_address else None
        policy = Policy(grace=config.grace, timeout=deadline.remaining() if config.timeout else None,
                        timeout_total=config.timeout, mps_required=config.mps == "on")
        self.controller = Controller(self.listener, self.name, self._welcome, policy, expected=None,
                                     session=self.session, upstream=upstream, note=self._log)
        self.controller.report_in_verdicts = upstream is None
        self.controller.before_last_verdict = self.close

    def _upstream(self) -> Link:
        link = connect(str(self.upstream_address))
        link.send("hello", role="node", token=self.upstream_token, node=socket.gethostname())
        if link.expect(("welcome",), Deadline(30.0)) is None:
            raise MPSError(f"the job's controller at {self.upstream_address} did not answer")
        return link

    def _welcome(self, identity: RankIdentity, hello: Mapping[str, Any]) -> dict[str, Any]:
        if hello.get("settings") != self.settings:
            raise ConfigError("the ranks on this node were started with different mpsrun options "
                              f"({hello.get('settings')!r}, not {self.settings!r})", setting="options")
        if hello.get("devices") != self.devices:
            raise ConfigError("the ranks on this node see different GPUs (CUDA_VISIBLE_DEVICES "
                              f"{hello.get('devices')!r}, not {self.devices!r}); mpsrun --per-node needs every "
                              "local rank to see the node's GPUs (no per-task GPU binding)", setting="gpus")
        if self.controller.expected_count is None:
            self.controller.expected_count = identity.local_world_size
        answer = welcome(identity, self.config, len(self.session.gpus), self.session.target,
                         free=self.session.free_memory(),
                         session_dir=str(self.session.dirs.root) if self.session.dirs else None)
        answer["lines"], self.notices = self.notices, []  # said once, by the first rank to join
        return answer

    def _log(self, text: str) -> None:
        """Into keeper.log, and through one of the node's ranks to the user (the job's controller says its own)."""
        say(f"mpsrun keeper: {text}")
        controller = getattr(self, "controller", None)
        if controller is not None and controller.upstream is None:
            for state in sorted(controller.table.live(), key=lambda s: s.rank):
                if state.link is not None and state.link.send("say", text=text):
                    return

    def close(self) -> list[str]:
        """The last rank is out: what to tell it, after the daemons are stopped and the session is gone."""
        if self.closed:
            return []
        self.closed = True
        self.controller.table.accepting = False
        lines = self._closing_lines()
        with user_root_lock(self.base):  # no rank may join a keeper that is closing
            self.listener.close()
            try:
                self.session.close()
            except MPSError as exc:
                lines.append(str(exc))
        if self.config.keep_logs and self.session.dirs is not None:
            lines.append(f"kept this node's session logs in {self.session.dirs.root}")
        if self.controller.upstream is not None:
            for line in lines:
                self.controller.upstream.send("note", text=line)
            return []
        return lines

    def _closing_lines(self) -> list[str]:
        lines: list[str] = []
        ranks = self.controller.ranks.values()
        watch = self.controller.watch
        if watch is not None and self.config.verbose:
            self.controller.settle_watch()
            lines.append(verified_line(watch, self.controller.ranks, f"node {socket.gethostname()}: "))
        if self.controller.judge.failed or self.controller.upstream is not None:
            rank_of = {s.process.pid: s.rank for s in ranks if s.process is not None}
            if self.session.enabled and any(s.end and s.end.returncode != 0 for s in ranks):
                lines += mps_report(self.session.daemons, rank_of)
        return lines

    def run(self) -> None:
        def idle() -> None:
            if not self.controller.ranks:
                self.controller.give_up = True

        self.controller.loop.after(IDLE_TIMEOUT, idle)
        try:
            self.controller.run()
        finally:
            self.close()


def _detach(log_dir: Path | None) -> None:
    """Leave the starting rank's pipes: our output goes to the session directory from now on."""
    target = os.open(log_dir / "keeper.log" if log_dir else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)


def _abandon_when_alone(started: threading.Event) -> None:
    """The rank waiting for our answer is gone (interrupted, killed: the reading end of our stdout closed)
    before we are ready: stop starting, as if told to."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLERR)  # on a pipe's writing end: no reader any more
    while not started.is_set():
        # Ready is said only after `started` is set, so a reader gone before then was not answered.
        if poller.poll(100) and not started.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main() -> int:
    request = json.loads(sys.stdin.read())
    if os.fork() > 0:
        os._exit(0)  # the starting rank waits for this; the keeper lives on in the background
    keeper: NodeKeeper | None = None
    started = threading.Event()
    threading.Thread(target=_abandon_when_alone, args=(started,), daemon=True).start()
    try:
        with Interrupts():  # a stopping signal while the session starts: undo it, say why, exit
            keeper = NodeKeeper(JobConfig(**parse_options(request["argv"], environ={})), request)
            keeper.start()
            started.set()
    except Exception as exc:  # the starting rank must hear why, whatever it was
        started.set()
        if keeper is not None and hasattr(keeper, "session"):
            with contextlib.suppress(MPSError):
                keeper.session.close()
        code = exc.exit_code if isinstance(exc, MPSError) else 3
        with contextlib.suppress(OSError):  # the starting rank may be gone
            print(f"{code} {exc if isinstance(exc, MPSError) else f'node keeper failed: {exc!r}'}", flush=True)
        return code
    try:
        print("ready", flush=True)
    except OSError:  # the rank that started us is gone (interrupted): nobody will come
        keeper.session.close()
        return 3
    _detach(keeper.session.dirs.root if keeper.session.dirs else None)
    keeper.run()
    return 0


if __name__ == "__main__":
    exit_now(main())  # the node's last rank waits for this process to end
