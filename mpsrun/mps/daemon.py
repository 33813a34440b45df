"""The control layer: one ``nvidia-cuda-mps-control`` per GPU, and its whole life cycle.

The daemon runs in the foreground (``-f``) in its own process group; in ``-f`` mode it
writes the control and server log to stdout, which goes to ``control.log``. Commands are
sent as the real tool's client mode does: one ``nvidia-cuda-mps-control`` call with the
command on stdin. That client exits 0 even when a command fails (measured), so replies are
parsed, never trusted by exit code.

One life cycle for every owner: :meth:`ControlDaemon.start` spawns a daemon,
:class:`~mpsrun.session.record.DaemonRecord` describes it for ``session.json``, and
:meth:`ControlDaemon.stop` ends it, whether this process started it or it was made again
from a record (a reaper, ``mpsrun cleanup``). Processes are identified by pid and start time, never by name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from mpsrun.config.values import mib_text
from mpsrun.errors import DaemonError, DaemonStartError, DaemonTimeoutError, MPSUnavailableError
from mpsrun.mps.limits import stored_mem_limit
from mpsrun.mps.replies import (
    NO_DAEMON,
    ServerStatus,
    is_error_reply,
    parse_pid_list,
    parse_server_status,
    reply_mib,
    reply_number,
    started_servers,
)
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.files import read_log
from mpsrun.runtime.processes import ProcessRef, parent_pid, set_parent_death_signal

__all__ = ["CONTROL_EXECUTABLE", "ControlDaemon", "find_control_executable"]

log = logging.getLogger(__name__)

CONTROL_EXECUTABLE = "nvidia-cuda-mps-control"


def find_control_executable(path: str | None = None) -> str:
    """Absolute path of ``nvidia-cuda-mps-control`` on ``PATH``; raise if missing."""
    found = shutil.which(CONTROL_EXECUTABLE, path=path)
    if found is None:
        raise MPSUnavailableError(
            f"{CONTROL_EXECUTABLE} is not on PATH (it ships with the NVIDIA driver)",
            reason="no control executable",
        )
    return found


def unavailable_reason(mode: str) -> str | None:
    """Why MPS will not run in this ``mode`` (``auto``/``on``/``off``) here, or None; GPUs are checked apart."""
    if mode == "off":
        return "MPS is off (mps='off')"
    try:
        find_control_executable()
    except MPSUnavailableError as exc:
        return exc.message
    return None


class ControlDaemon:
    """One private MPS control daemon serving one GPU (or, under ``--gpu-bind none``, several).

    ``devices`` (a GPU's UUID, or several comma-separated) is passed to the daemon as
    ``CUDA_VISIBLE_DEVICES`` so the daemon (and its server) see exactly those GPUs, in that
    order, whatever the caller's own device numbering.
    """

    __slots__ = ("_popen", "_servers", "answered", "base_env", "command_timeout", "devices", "executable", "log_dir",
                 "pipe_dir", "process", "silent")

    def __init__(self, devices: str, pipe_dir: Path, log_dir: Path, executable: str = CONTROL_EXECUTABLE,
                 base_env: Mapping[str, str] | None = None, command_timeout: float = 10.0,
                 process: ProcessRef | None = None) -> None:
        self.devices, self.pipe_dir, self.log_dir, self.executable = devices, pipe_dir, log_dir, executable
        self.base_env, self.command_timeout, self.process = base_env, command_timeout, process
        self._popen: subprocess.Popen[bytes] | None = None
        self._servers: dict[int, ProcessRef] = {}
        self.answered = False  # it has answered a command: it can take `quit`
        self.silent = ""  # then it left one unanswered (said so): no more commands are sent

    @property
    def env(self) -> dict[str, str]:
        """Environment for the daemon and for control commands sent to it."""
        env = dict(os.environ if self.base_env is None else self.base_env)
        env["CUDA_VISIBLE_DEVICES"] = self.devices
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return env

    @property
    def log_file(self) -> Path:
        return self.log_dir / "control.log"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return self.process is not None and self.process.alive()

    @property
    def server_pids(self) -> list[int]:
        """Servers this daemon has started, as far as we have seen."""
        return list(self._servers)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = read_log(self.log_file, start=0).decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- life cycle -------------------------------------------------------------------

    def start(self, timeout: float = 30.0, parent_death: bool = True) -> None:
        """Spawn the daemon and wait (with a deadline) until it answers a command."""
        self.spawn(parent_death)
        self.await_answer(timeout)

    def spawn(self, parent_death: bool = True) -> None:
        """Start the daemon's process and return at once; :meth:`await_answer` waits for it.

        ``parent_death``: the daemon gets SIGKILL when the thread that starts it ends.
        Only the main thread should ask for it; the session's reaper covers the rest.
        """
        if self.process is not None:
            raise DaemonError("this daemon was already started")
        self.executable = shutil.which(self.executable, path=self.env.get("PATH")) or self.executable
        with open(self.log_file, "ab") as log_out:
            try:
                self._popen = subprocess.Popen(
                    [self.executable, "-f"], stdin=subprocess.DEVNULL, stdout=log_out, stderr=subprocess.STDOUT,
                    env=self.env, cwd=self.log_dir, start_new_session=True,
                    preexec_fn=functools.partial(set_parent_death_signal, signal.SIGKILL, os.getpid())
                    if parent_death else None,
                )
            except OSError as exc:
                raise DaemonStartError(f"cannot start {self.executable}: {exc.strerror}", command="-f") from exc
        self.process = ProcessRef.of(self._popen.pid) or ProcessRef(self._popen.pid, -1)
        log.debug("mpsrun: started MPS control daemon pid %d for %s", self._popen.pid, self.devices)

    def await_answer(self, timeout: float) -> None:
        """:meth:`wait_ready`; a daemon that does not answer is ended at once (no quit to wait for)."""
        try:
            self.wait_ready(timeout)
        except BaseException:
            self._end_group(grace=1.0)
            raise

    def wait_ready(self, timeout: float) -> None:
        """Poll until the daemon answers ``get_server_list``; never a fixed sleep."""
        deadline = Deadline(timeout)
        socket = self.pipe_dir / "control"

        def listening() -> bool | None:  # a look at the directory costs microseconds: look often
            self._check_running("while starting")
            return socket.exists() or None

        def answers() -> bool | None:
            self._check_running("while starting")
            with contextlib.suppress(DaemonError):
                self.command("get_server_list", timeout=max(0.1, deadline.remaining()))
                return True
            return None

        self.answered = bool(poll_until(listening, deadline, cap=0.001) and poll_until(answers, deadline))
        if not self.answered:
            raise DaemonTimeoutError(f"MPS control daemon did not answer within {timeout:.3g} s (its log: "
                                     f"{self.log_tail(1) or 'empty'})", command="get_server_list",
                                     log_tail=self.log_tail())

    def _check_running(self, doing: str) -> None:
        if not self.alive:
            code = self._popen.returncode if self._popen is not None else None
            tail = self.log_tail()
            raise DaemonStartError(f"MPS control daemon exited{'' if code is None else f' with code {code}'} {doing}"
                                   + (f"; last log line: {tail.splitlines()[-1]}" if tail else ""), log_tail=tail)

    def stop(self, timeout: float = 10.0, grace: float = 2.0) -> str | None:
        """Stop the daemon and its servers: ``quit``, then signals to its process group. Why it was ended by signal,
        where ``quit`` was sent and did not end it (the caller says so); None otherwise.

        ``quit`` blocks while clients are alive, so it gets a deadline; after that (or at once, for a daemon
        not yet listening or no longer answering, or one whose control socket a rank removed) its process group gets
        SIGTERM, then SIGKILL. Then every server we saw is checked to be gone (by pid and start time; never by name).
        """
        if self.process is None:
            return None
        deadline, forced = Deadline(timeout), None
        if self.alive and (self.silent or not self.answered) and self._popen is not None:
            self._end_group(grace)  # its silence was said where it was met: quit would only wait it out again
        elif self.alive:
            self._remember_servers()
            try:
                self.command("quit", timeout=max(0.1, deadline.remaining()))
            except DaemonTimeoutError:
                pass
            except DaemonError as exc:  # not reached at all: nothing to wait for
                log.debug("quit failed: %s", exc)
                deadline, forced = Deadline(0), f"did not take quit ({exc.reply or exc})"
            if not self._wait_exit(deadline.remaining()):
                forced = forced or f"did not quit in {timeout:g} s"
                self._end_group(grace)
        self._reap_servers(grace)
        return forced

    def _remember_servers(self) -> None:
        """Every server the daemon started, to check they are gone afterwards: its log names each one (no
        command to send); a daemon whose log cannot be read is asked."""
        try:
            text = read_log(self.log_file, start=0).decode(errors="replace")
        except OSError:
            with contextlib.suppress(DaemonError):
                self.server_list()
            return
        for pid in started_servers(text):
            self.saw_server(pid, from_log=True)

    def _end_group(self, grace: float) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._signal_group(sig)
            if sig == signal.SIGTERM:
                self._signal_group(signal.SIGCONT)  # a stopped daemon takes its SIGTERM now, not at SIGKILL
            if self._wait_exit(grace):
                return

    def _wait_exit(self, seconds: float) -> bool:
        if self._popen is not None:
            try:
                self._popen.wait(timeout=max(0.01, seconds))
            except subprocess.TimeoutExpired:
                return False
            return True
        return bool(poll_until(lambda: (not self.alive) or None, Deadline(seconds)))

    def _signal_group(self, sig: int) -> None:
        if self._popen is not None and self._popen.returncode is None:
            # Our child and not yet reaped: its pid (= its group id) cannot have been reused.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, sig)
        elif self.process is not None:
            self.process.signal_group(sig)

    def _reap_servers(self, grace: float) -> None:
        """Check every server we saw is gone (a zombie counts as gone); SIGKILL one by pid if not."""
        survivors: list[int] = []
        for server in self._servers.values():
            gone = lambda s=server: (not s.alive()) or None  # noqa: E731
            if poll_until(gone, Deadline(grace)):
                continue
            log.warning("mpsrun: MPS server %d outlived its daemon; killing it", server.pid)
            server.signal(signal.SIGKILL)
            if not poll_until(gone, Deadline(grace)):
                survivors.append(server.pid)
        if survivors:
            raise DaemonError(f"MPS server process(es) {survivors} survived the daemon's shutdown")

    # -- commands ---------------------------------------------------------------------

    def _run_client(self, text: str, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            # Its own session, as the daemon's: a Ctrl-C to the job's group killed a quit the daemon never had.
            return subprocess.run([self.executable], input=text + "\n", capture_output=True, text=True,
                                  env=self.env, timeout=timeout, check=False, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            # Answered before, not in a second now: stopped or stuck, and later commands would wait too. (quit
            # blocks while clients live, as documented; a deadline cut short by the caller's says nothing.)
            why = f"MPS control command {text!r} got no answer within {timeout:g} s"
            if self.answered and text != "quit" and timeout >= 1.0 and not self.silent:
                self.silent = f"the MPS control daemon stopped answering ({why})"
            raise DaemonTimeoutError(self.silent or why, command=text, log_tail=self.log_tail()) from exc
        except OSError as exc:
            raise DaemonError(f"cannot run {self.executable}: {exc.strerror}", command=text) from exc

    def command(self, text: str, timeout: float | None = None) -> str:
        """Send one control command and return its reply; raise :class:`DaemonError` on failure."""
        if self.silent:
            raise DaemonTimeoutError(self.silent, command=text, log_tail=self.log_tail())
        result = self._run_client(text, self.command_timeout if timeout is None else timeout)
        reply = (result.stdout + result.stderr).strip()
        if result.returncode != 0 or reply.startswith(NO_DAEMON):
            raise DaemonError(f"MPS control command {text!r} failed: {reply or f'exit code {result.returncode}'}",
                              command=text, reply=reply, log_tail=self.log_tail())
        if is_error_reply(reply):
            first = reply.splitlines()[0]
            raise DaemonError(f"MPS control command {text!r} failed: {first}", command=text, reply=reply)
        return reply

    def set_defaults(self, thread_percentage: int | None = None, mem_limit: int | None = None) -> None:
        """Set limits for servers started later (call before :meth:`start_server`); ``mem_limit`` in MiB."""
        # The daemon prints no error for a bad value (recorded: it answers an invalid
        # percentage with the old one and stores "12Q" as 12M), so each setting is read back.
        if thread_percentage is not None:
            command = f"set_default_active_thread_percentage {thread_percentage}"
            reply = self.command(command)
            if reply_number(reply) != float(thread_percentage):
                raise DaemonError(f"the daemon did not take {command!r} (it answered {reply!r})", command=command,
                                  reply=reply)
        for device in range(len(self.devices.split(",")) if mem_limit is not None else 0):
            # Devices are numbered as the daemon sees them: the order of CUDA_VISIBLE_DEVICES.
            assert mem_limit is not None
            command = f"set_default_device_pinned_mem_limit {device} {mib_text(mem_limit)}"
            self.command(command)
            stored = self.command(f"get_default_device_pinned_mem_limit {device}")
            if reply_mib(stored) != stored_mem_limit(mem_limit):  # 1536M is stored as 1G
                raise DaemonError(f"the daemon did not take {command!r} (it stored {stored!r})", command=command,
                                  reply=stored)

    def start_server(self, uid: int | None = None, timeout: float = 30.0, wait: bool = True) -> int | None:
        """Start this user's server now (not lazily at the first client); by default wait for ACTIVE.

        With ``wait=False`` only the request is sent (the daemon queues clients that come
        before the server is ready); call :meth:`wait_active` later.
        """
        uid = os.getuid() if uid is None else uid
        self.command(f"start_server -uid {uid}")
        return self.wait_active(timeout) if wait else None

    def wait_active(self, timeout: float = 30.0) -> int:
        """Poll until this daemon's server reports ACTIVE; return its pid."""
        seen: list[ServerStatus] = []

        def active() -> int | None:
            self._check_running("while starting its server")
            servers = self.server_list()
            if not servers:
                return None
            seen.append(self.server_status(servers[0]))
            if seen[-1] is ServerStatus.FAULT:
                raise DaemonError(f"MPS server {servers[0]} is in FAULT state", command="get_server_status",
                                  reply="FAULT")
            return servers[0] if seen[-1] is ServerStatus.ACTIVE else None

        server = poll_until(active, Deadline(timeout))
        if server is None:
            raise DaemonTimeoutError(f"MPS server did not become ACTIVE within {timeout:g} s (last state: "
                                     f"{seen[-1].value if seen else 'no server'}); log: {self.log_file}",
                                     command="get_server_status", log_tail=self.log_tail())
        return server

    def server_list(self, timeout: float | None = None) -> list[int]:
        """PIDs of this daemon's servers (also remembered for the shutdown check)."""
        pids = parse_pid_list(self.command("get_server_list", timeout))
        for pid in pids:
            self.saw_server(pid)
        return pids

    def saw_server(self, pid: int, from_log: bool = False) -> None:
        """Remember a server of this daemon, to check at shutdown that it is gone. A pid from the log may be a
        server long gone whose number is now another process's: it counts only while it is the daemon's child."""
        if pid in self._servers or (from_log and (self.pid is None or parent_pid(pid) != self.pid)):
            return
        if (server := ProcessRef.of(pid)) is not None:
            self._servers[pid] = server

    def server_status(self, server_pid: int, timeout: float | None = None) -> ServerStatus:
        reply = self.command(f"get_server_status {server_pid}", timeout)
        try:
            return parse_server_status(reply)
        except ValueError:
            raise DaemonError(f"unexpected reply to get_server_status: {reply!r}", command="get_server_status",
                              reply=reply) from None

    def client_list(self, server_pid: int, timeout: float | None = None) -> list[int]:
        return parse_pid_list(self.command(f"get_client_list {server_pid}", timeout))

    def clients(self) -> set[int]:
        """PIDs of every client connected to any of this daemon's servers."""
        result: set[int] = set()
        for server in self.server_list():
            result.update(self.client_list(server))
        return result

    def terminate_client(self, server_pid: int, client_pid: int, timeout: float | None = None) -> None:
        """Ask the server to end a client's work (it fails at its next CUDA call)."""
        self.command(f"terminate_client {server_pid} {client_pid}", timeout)
