"""The control layer: one supervised ``nvidia-cuda-mps-control`` per GPU.

The daemon runs in the foreground (``-f``) as our child, in its own process group,
with a parent-death signal so it cannot outlive us; in ``-f`` mode it writes the
control and server log to stdout, which goes to ``control.log``. Commands are sent
as the real tool's client mode does: one ``nvidia-cuda-mps-control`` call with the
command on stdin. That client exits 0 even when a command fails (measured), so
replies are parsed, never trusted by exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import attrs
import psutil

from mpsrun import gpus as gpu_info
from mpsrun.errors import DaemonError, DaemonStartError, DaemonTimeoutError, MPSUnavailableError

__all__ = [
    "CONTROL_EXECUTABLE",
    "ControlDaemon",
    "PsEntry",
    "ServerStatus",
    "diagnose_log",
    "find_control_executable",
    "parse_pid_list",
    "parse_ps",
    "parse_server_status",
]

log = logging.getLogger(__name__)

CONTROL_EXECUTABLE = "nvidia-cuda-mps-control"
_NO_DAEMON = "Cannot find MPS control daemon process"
# Replies the daemon prints instead of a result when a command fails (rc stays 0).
_ERROR_REPLY = re.compile(
    r"^(Unknown command|Invalid|Incorrect|Usage|Not enough privilege|Server \d+ not found|.*\bnot found\b"
    r"|.*\b[Ee]rror\b|.*\bfailed\b)"
)
_PR_SET_PDEATHSIG = 1


class ServerStatus(enum.Enum):
    """States an MPS server reports through ``get_server_status``."""

    INITIALIZING = "INITIALIZING"
    ACTIVE = "ACTIVE"
    FAULT = "FAULT"


@attrs.frozen
class PsEntry:
    """One row of the daemon's ``ps`` command: a client or server process."""

    pid: int
    device: str
    server_pid: int
    name: str


def find_control_executable(path: str | None = None) -> str:
    """Absolute path of ``nvidia-cuda-mps-control`` on ``PATH``; raise if missing."""
    found = shutil.which(CONTROL_EXECUTABLE, path=path)
    if found is None:
        raise MPSUnavailableError(
            f"{CONTROL_EXECUTABLE} is not on PATH (it ships with the NVIDIA driver)",
            reason="no control executable",
        )
    return found


def parse_pid_list(reply: str) -> list[int]:
    """PIDs printed one per line (``get_server_list``, ``get_client_list``)."""
    return [int(line) for line in reply.split() if line.isdigit()]


def parse_server_status(reply: str) -> ServerStatus:
    """The state in a ``get_server_status`` reply; raise :class:`ValueError` otherwise."""
    return ServerStatus(reply.strip())


def parse_ps(reply: str) -> list[PsEntry]:
    """Rows of the ``ps`` command (recorded on an H100)::

        PID       ID        SERVER         DEVICE                    NAMESPACE      COMMAND
        8216      1         8176           GPU-5ecd2ecb-5789-2238    4026531836     /usr/bin/python3

    Columns are found by name in the header, so an added column does not break us.
    ``Server not found`` (no server) and an empty reply (no clients) give no rows.
    """
    lines = [line for line in reply.splitlines() if line.strip()]
    if not lines or "PID" not in lines[0].split():
        return []
    header = lines[0].split()
    column = {name: i for i, name in enumerate(header)}
    rows: list[PsEntry] = []
    for line in lines[1:]:
        parts = line.split(None, len(header) - 1)
        if len(parts) < len(header) or not parts[column["PID"]].isdigit():
            continue
        server = parts[column["SERVER"]] if "SERVER" in column else ""
        rows.append(
            PsEntry(
                pid=int(parts[column["PID"]]),
                device=parts[column["DEVICE"]] if "DEVICE" in column else "",
                server_pid=int(server) if server.isdigit() else 0,
                name=parts[-1].strip(),
            )
        )
    return rows


_LOG_FINDINGS = (
    (
        re.compile(r"Maximum number of clients \((\d+)\) reached"),
        "the MPS server refused clients: maximum number of clients ({0}) reached; use fewer ranks per GPU or more GPUs",
    ),
    (
        re.compile(r"encountered a fatal GPU error"),
        "a client hit a fatal GPU error: the MPS server tore down every client with work in flight, "
        "so other ranks may have failed with it",
    ),
)


def diagnose_log(text: str) -> list[str]:
    """Plain-language findings from an MPS control/server log (each at most once)."""
    findings = []
    for pattern, message in _LOG_FINDINGS:
        match = pattern.search(text)
        if match:
            findings.append(message.format(*match.groups()))
    return findings


_TORN_DOWN = re.compile(r"Client \{PID: (\d+), Context ID: \d+\} on device \d+ to be torn down")


def torn_down_clients(text: str) -> list[int]:
    """PIDs of the clients an MPS server tore down after a fatal GPU fault (from its log).

    The log does not tell reliably which client caused the fault (recorded on an H100, it
    named a bystander as the one that "encountered" it; NVIDIA documents that the error is
    reported to all clients without saying which one generated it), so only the victims
    are read.
    """
    return sorted({int(pid) for pid in _TORN_DOWN.findall(text)})


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child before exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    """Poll until ``proc`` has exited; a zombie (exited, not yet reaped by its parent) counts."""
    deadline = time.monotonic() + timeout
    for delay in _backoff():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
    return False  # pragma: no cover


def _backoff(first: float = 0.002, factor: float = 1.5, cap: float = 0.05) -> Iterator[float]:
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * factor)


@attrs.define(eq=False)
class ControlDaemon:
    """One private MPS control daemon serving one GPU.

    ``gpu_uuid`` is passed to the daemon as ``CUDA_VISIBLE_DEVICES`` so the daemon (and
    its server) see exactly that GPU, whatever the caller's own device numbering.
    """

    gpu_uuid: str
    pipe_dir: Path
    log_dir: Path
    executable: str = CONTROL_EXECUTABLE
    base_env: Mapping[str, str] | None = None
    command_timeout: float = 10.0
    #: Per-node sessions: the daemon serves every local rank, so it must not die with the
    #: rank that happened to start it; `mpsrun cleanup` finds it if all of them are killed.
    outlive_parent: bool = False
    _process: subprocess.Popen[bytes] | None = attrs.field(default=None, init=False)
    _servers: dict[int, float] = attrs.field(factory=dict, init=False)  # pid -> create time

    @property
    def env(self) -> dict[str, str]:
        """Environment for the daemon and for control commands sent to it."""
        env = dict(os.environ if self.base_env is None else self.base_env)
        env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return env

    @property
    def log_file(self) -> Path:
        return self.log_dir / "control.log"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def server_pids(self) -> list[int]:
        """Servers this daemon has started, as far as we have seen."""
        return list(self._servers)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- life cycle -------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Spawn the daemon and wait (with a deadline) until it answers a command."""
        if self._process is not None:
            raise DaemonError("this daemon was already started")
        executable = shutil.which(self.executable, path=self.env.get("PATH")) or self.executable
        self.executable = executable
        with open(self.log_file, "ab") as log_out:
            try:
                self._process = subprocess.Popen(
                    [executable, "-f"],
                    stdin=subprocess.DEVNULL,
                    stdout=log_out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.log_dir,
                    start_new_session=True,
                    preexec_fn=None if self.outlive_parent else _set_parent_death_signal,
                )
            except OSError as exc:
                raise DaemonStartError(f"cannot start {executable}: {exc.strerror}", command="-f") from exc
        log.debug("started MPS control daemon pid %d for %s", self._process.pid, self.gpu_uuid)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def wait_ready(self, timeout: float) -> None:
        """Poll until the daemon answers ``get_server_list``; never a fixed sleep."""
        deadline = time.monotonic() + timeout
        socket = self.pipe_dir / "control"
        for delay in _backoff():
            self._check_running("while starting")
            if socket.exists():
                result = self._run_client("get_server_list", max(0.1, deadline - time.monotonic()))
                if result.returncode == 0:
                    return
            if time.monotonic() + delay > deadline:
                raise DaemonTimeoutError(
                    f"MPS control daemon did not answer within {timeout:g} s; log: {self.log_file}",
                    command="get_server_list",
                    log_tail=self.log_tail(),
                )
            time.sleep(delay)

    def _check_running(self, doing: str) -> None:
        if self._process is None:
            raise DaemonError("the daemon has not been started")
        code = self._process.poll()
        if code is not None:
            tail = self.log_tail()
            raise DaemonStartError(
                f"MPS control daemon exited with code {code} {doing}"
                + (f"; last log line: {tail.splitlines()[-1]}" if tail else ""),
                log_tail=tail,
            )

    def stop(self, timeout: float = 10.0, grace: float = 2.0) -> None:
        """Stop the daemon and its servers: ``quit``, then signals to its process group.

        ``quit`` blocks while clients are alive, so it gets a deadline; after that the
        daemon's own process group gets SIGTERM, then SIGKILL. Finally every server we
        saw is checked to be gone (by pid and start time; never by name).
        """
        process = self._process
        if process is None:
            return
        deadline = time.monotonic() + timeout
        if process.poll() is None:
            with contextlib.suppress(DaemonError):
                self.server_list()  # remember every server, to check they are gone afterwards
            try:
                self.command("quit", timeout=max(0.1, deadline - time.monotonic()))
            except DaemonError as exc:
                log.debug("quit failed: %s", exc)
            try:
                process.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("MPS control daemon %d did not quit in %g s; terminating it", process.pid, timeout)
                self._signal_group(process, signal.SIGTERM)
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self._signal_group(process, signal.SIGKILL)
                    process.wait()
        self._reap_servers(grace)

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
        # The daemon is not reaped yet, so its pid (= its group id) cannot have been reused.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)

    def _reap_servers(self, grace: float) -> None:
        """Check every server we saw is gone (a zombie counts as gone); SIGKILL one by pid if not."""
        survivors: list[int] = []
        for pid, created in self._servers.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) > 0.01:
                    continue  # the pid now belongs to someone else
            except psutil.NoSuchProcess:
                continue
            if _wait_gone(proc, grace):
                continue
            log.warning("MPS server %d outlived its daemon; killing it", pid)
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
            if not _wait_gone(proc, grace):
                survivors.append(pid)
        if survivors:
            raise DaemonError(f"MPS server process(es) {survivors} survived the daemon's shutdown")

    # -- commands ---------------------------------------------------------------------

    def _run_client(self, text: str, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.executable],
                input=text + "\n",
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DaemonTimeoutError(
                f"MPS control command {text!r} got no answer within {timeout:g} s",
                command=text,
                log_tail=self.log_tail(),
            ) from exc
        except OSError as exc:
            raise DaemonError(f"cannot run {self.executable}: {exc.strerror}", command=text) from exc

    def command(self, text: str, timeout: float | None = None) -> str:
        """Send one control command and return its reply; raise :class:`DaemonError` on failure."""
        result = self._run_client(text, self.command_timeout if timeout is None else timeout)
        reply = (result.stdout + result.stderr).strip()
        if result.returncode != 0 or reply.startswith(_NO_DAEMON):
            raise DaemonError(
                f"MPS control command {text!r} failed: {reply or f'exit code {result.returncode}'}",
                command=text,
                reply=reply,
                log_tail=self.log_tail(),
            )
        first = reply.splitlines()[0] if reply else ""
        if _ERROR_REPLY.match(first):
            raise DaemonError(f"MPS control command {text!r} failed: {first}", command=text, reply=reply)
        return reply

    def set_defaults(self, thread_percentage: int | None = None, mem_limit: str | None = None) -> None:
        """Set limits for servers started later (call before :meth:`start_server`)."""
        # The daemon prints no error for a bad value (recorded: it answers an invalid
        # percentage with the old one and stores "12Q" as 12M), so each setting is read back.
        if thread_percentage is not None:
            command = f"set_default_active_thread_percentage {thread_percentage}"
            reply = self.command(command)
            if _as_float(reply) != float(thread_percentage):
                raise DaemonError(
                    f"the daemon did not take {command!r} (it answered {reply!r})", command=command, reply=reply
                )
        if mem_limit is not None:
            # Device 0 is this daemon's only device (CUDA_VISIBLE_DEVICES = one UUID).
            command = f"set_default_device_pinned_mem_limit 0 {mem_limit}"
            self.command(command)
            stored = self.command("get_default_device_pinned_mem_limit 0")
            if stored != mem_limit:
                raise DaemonError(
                    f"the daemon did not take {command!r} (it stored {stored!r})", command=command, reply=stored
                )

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
        deadline = time.monotonic() + timeout
        status: ServerStatus | None = None
        for delay in _backoff():
            self._check_running("while starting its server")
            servers = self.server_list()
            if servers:
                status = self.server_status(servers[0])
                if status is ServerStatus.ACTIVE:
                    return servers[0]
                if status is ServerStatus.FAULT:
                    raise DaemonError(
                        f"MPS server {servers[0]} is in FAULT state", command="get_server_status", reply="FAULT"
                    )
            if time.monotonic() + delay > deadline:
                raise DaemonTimeoutError(
                    f"MPS server did not become ACTIVE within {timeout:g} s (last state: "
                    f"{status.value if status else 'no server'}); log: {self.log_file}",
                    command="get_server_status",
                    log_tail=self.log_tail(),
                )
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def server_list(self) -> list[int]:
        """PIDs of this daemon's servers (also remembered for the shutdown check)."""
        pids = parse_pid_list(self.command("get_server_list"))
        for pid in pids:
            if pid not in self._servers:
                with contextlib.suppress(psutil.Error):
                    self._servers[pid] = psutil.Process(pid).create_time()
        return pids

    def server_status(self, server_pid: int) -> ServerStatus:
        reply = self.command(f"get_server_status {server_pid}")
        try:
            return parse_server_status(reply)
        except ValueError:
            raise DaemonError(
                f"unexpected reply to get_server_status: {reply!r}", command="get_server_status", reply=reply
            ) from None

    def client_list(self, server_pid: int) -> list[int]:
        return parse_pid_list(self.command(f"get_client_list {server_pid}"))

    def clients(self) -> set[int]:
        """PIDs of every client connected to any of this daemon's servers."""
        result: set[int] = set()
        for server in self.server_list():
            result.update(self.client_list(server))
        return result

    def judge_clients(self, pids: Iterable[int]) -> tuple[set[int], set[int]]:
        """Split ``pids`` into this daemon's clients and processes that missed it.

        Returns (the pids that are clients of our servers, the pids holding a plain CUDA
        context on our GPU without being one: CUDA's silent fallback). A silent fallback
        shows in NVML as a plain context (type C), never as an MPS client (M+C); NVML is
        read before the client list, so a process it shows as connected is listed by then.
        """
        wanted = set(pids)
        contexts = gpu_info.compute_processes(self.gpu_uuid)
        clients = self.clients()
        plain = {pid for pid, is_mps in contexts.items() if not is_mps} - set(self.server_pids)
        return wanted & clients, (wanted & plain) - clients

    def ps(self) -> list[PsEntry]:
        """The daemon's clients (``ps``); none when there is no server."""
        try:
            return parse_ps(self.command("ps"))
        except DaemonError as exc:
            if exc.reply.strip() == "Server not found":
                return []
            raise

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Ask the server to end a client's work (it fails at its next CUDA call)."""
        self.command(f"terminate_client {server_pid} {client_pid}")
