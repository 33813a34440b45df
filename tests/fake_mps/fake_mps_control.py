"""A test double of ``nvidia-cuda-mps-control`` for machines without a GPU.

It speaks the real tool's interface as recorded on an H100 (tests/data/h100/):

* ``-f``: run the control daemon in the foreground, log lines on stdout;
* ``-h``: print the help;
* no argument: client mode, one command per stdin line, replies on stdout, exit 1
  with "Cannot find MPS control daemon process" when no daemon answers, exit 0
  otherwise, even when the command failed (as the real one does).

The daemon listens on ``$CUDA_MPS_PIPE_DIRECTORY/control`` (a UNIX socket, as the
real one) and keeps its state in memory. Fake CUDA programs (``fakecuda.py``)
connect through the same socket with private ``__client`` commands (a client keeps
its connection, on which the daemon tells it of its end), so client
lists, ``quit`` blocking while clients live, ``terminate_client`` and server faults
behave as on the real daemon. The server is a real child process that dies with
the daemon. Fault injection for tests, through the daemon's environment:

* ``FAKE_MPS_START_FAIL=1``: the daemon prints an error and exits 1 at once;
* ``FAKE_MPS_NO_ANSWER=1``: the daemon runs but never opens its socket;
* ``FAKE_MPS_ANSWER_AFTER=S``: it opens its socket only after S seconds;
* ``FAKE_MPS_QUIT_HANG=1``: ``quit`` never returns (the daemon ignores SIGTERM too);
* ``FAKE_MPS_QUIT_CLIENT_WAIT=S``: the client that sends ``quit`` waits S seconds first (a slow start);
* ``FAKE_MPS_INIT_POLLS=N``: a new server answers INITIALIZING N times first;
* ``FAKE_MPS_MAX_CLIENTS=N``: the server's client limit (48, as recorded on the H100).

Each GPU's clients share its 126 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS each, 2 unset), as measured on the
H100: a client beyond them fails to connect.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from fake_mps_client import NO_DAEMON, run_client, run_server, send

__all__ = ["NO_DAEMON", "main", "send"]
# os.path, not pathlib, and json only when needed: the daemon starts with every session (thousands in the suite),
# and those imports (re, enum, urllib) were half its start-up.
HERE = os.path.dirname(os.path.realpath(__file__))
RECORDING = os.path.join(os.path.dirname(HERE), "data", "h100", "transcript.json")
CLIENT = os.path.join(HERE, "fake_mps_client.py")
GPU_QUEUES = 126  # measured on the H100, driver 580 (issue 40; mpsrun.mps.limits.GPU_CONNECTIONS)  # its server starts on built-in modules


class _Listener(socketserver.ThreadingUnixStreamServer):
    # socketserver listens with a backlog of 5: 40 or more ranks connecting at once got refused, a failure the real
    # daemon (which takes up to 48 clients per server) never gives.
    request_queue_size = 128


def recorded_reply(command: str) -> str:
    """The real daemon's recorded output for ``command`` (tests/data/h100/transcript.json)."""
    import json

    with open(RECORDING) as recording:
        records = json.load(recording)["records"]
    return next(r["stdout"] for r in records if r.get("cmd") == command)




def pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


class State:
    """Everything the fake daemon knows; guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a client's state changed (terminated, faulted)
        # The devices this daemon serves, in order (several under mpsrun --gpu-bind none).
        self.uuids = (os.environ.get("CUDA_VISIBLE_DEVICES") or "GPU-fake").split(",")
        self.uuid = self.uuids[0]
        self.default_atp = "100.0"
        self.default_mem: dict[str, str] = {}
        self.default_priority = "0"
        self.server: subprocess.Popen[bytes] | None = None
        self.server_atp = "100.0"
        self.server_mem: dict[str, str] = {}
        self.init_polls = int(os.environ.get("FAKE_MPS_INIT_POLLS", "0"))
        self.clients: dict[int, str] = {}  # pid -> "ok" | "terminated" | "fault"
        self.queues: dict[int, tuple[str, int]] = {}  # pid -> its GPU and its hardware queues
        self.quitting = False

    def log(self, line: str, who: str = "Control", pid: int | None = None) -> None:
        for part in line.split("\n"):
            print(f"[{stamp()} {who} {pid or os.getpid():5d}] {part}", flush=True)

    def server_log(self, line: str) -> None:
        self.log(line, "Server", self.server_pid())

    def live_clients(self) -> list[int]:
        for pid in [p for p in self.clients if not pid_alive(p)]:
            del self.clients[pid]
            self.queues.pop(pid, None)
            self.server_log(f"Client process {pid} disconnected")
        return sorted(self.clients)

    def ensure_server(self) -> int:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [sys.executable, "-S", CLIENT, "--server", self.uuid],
                stdin=subprocess.PIPE,
                stdout=sys.stdout,
                stderr=subprocess.STDOUT,
            )
            self._await_server_entry()
            self.server_atp = self.default_atp
            self.server_mem = dict(self.default_mem)
            self.log(f"Starting new server {self.server.pid} for user {os.getuid()}", pid=self.server.pid)
            self.server_log(f"Active Threads Percentage set to {self.server_atp}")
            for device, limit in self.default_mem.items():
                self.server_log(f"Device pinned memory limit for device {device} set to {limit}")
            self.server_log("Server has started")
            self.log(f"NEW SERVER {self.server.pid}: Ready")
        return self.server.pid

    def _await_server_entry(self) -> None:
        """Until the new server shows in the fake NVML (a real server exists before its clients connect to it: a
        client answered first was listed before its server, once, under load)."""
        nvml_dir = os.environ.get("MPSRUN_FAKE_NVML")
        assert self.server is not None
        if not nvml_dir:
            return
        entry, deadline = os.path.join(nvml_dir, "procs", str(self.server.pid)), time.monotonic() + 5
        while not os.path.exists(entry) and self.server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)

    def server_pid(self) -> int | None:
        if self.server is not None and self.server.poll() is None:
            return self.server.pid
        return None

    def stop_server(self) -> None:
        if self.server is not None:
            self.log(f"Try shutting down server {self.server.pid}, backoff is disabled")
            if self.server.stdin:
                self.server.stdin.close()
            self.server.wait()
            self.log(f"Server {self.server.pid} exited with status 0")
            self.server = None


def is_server(state: State, text: str) -> bool:
    return text.isdigit() and state.server_pid() == int(text)


def handle(state: State, line: str) -> tuple[str, bool]:
    """Reply to one command; the flag says the daemon should exit afterwards."""
    words = line.split()
    if not words:
        return "", False
    cmd, args = words[0], words[1:]
    if cmd == "quit":
        with state.lock:
            state.log("Accepting connection...\nNEW UI\nCmd:quit")  # as the H100's daemon logs it
        state.quitting = True
        while True:
            with state.lock:
                if not state.live_clients():
                    break
            time.sleep(0.02)
        if os.environ.get("FAKE_MPS_QUIT_HANG"):
            while True:
                time.sleep(1)
        with state.lock:
            state.stop_server()
            state.log("Exit with status 0")
        return "", True
    with state.lock:
        if cmd.startswith("__client"):
            return dispatch(state, cmd, args), False
        state.log(f"Accepting connection...\nNEW UI\nCmd:{line}")
        reply = dispatch(state, cmd, args)
        if reply:
            state.log(reply)
        state.log("UI closed")
        return reply, False


def hold_client(state: State, line: str, write: Callable[[bytes], object]) -> None:
    """A client's connection, from its attach to its end: the reply, then one line when its state changes
    ("terminated", "fault"). Ends quietly when the client does."""
    reply = handle(state, line)[0]
    write(reply.encode() + b"\n")
    if not reply.startswith("ok"):
        return
    pid = int(line.split()[1])
    with state.lock:
        while state.clients.get(pid) == "ok" and pid_alive(pid):
            state.changed.wait(1.0)
        news = state.clients.get(pid)
    if news in ("terminated", "fault"):
        with contextlib.suppress(OSError):  # (a client that just ended)
            write(f"{news}\n".encode())


def dispatch(state: State, cmd: str, args: list[str]) -> str:
    if cmd == "get_server_list":
        pid = state.server_pid()
        return "" if pid is None else str(pid)
    if cmd == "start_server":
        if len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
            state.ensure_server()
            return ""
        return 'Invalid arguments for "start_server"'
    if cmd == "get_server_status":
        if len(args) != 1:
            return 'Invalid arguments for "get_server_status"'
        if not is_server(state, args[0]):
            return f"Server {args[0]} not found"
        if state.init_polls > 0:
            state.init_polls -= 1
            return "INITIALIZING"
        return "ACTIVE"
    if cmd == "get_client_list":
        if len(args) != 1 or not is_server(state, args[0]):
            return f"Server {args[0] if args else ''} not found"
        return "\n".join(str(p) for p in state.live_clients())
    if cmd == "ps":
        server = state.server_pid()
        if server is None:
            return "Server not found"
        clients = state.live_clients()
        if not clients:
            return ""
        rows = [f"{'PID':<10}{'ID':<10}{'SERVER':<15}{'DEVICE':<26}{'NAMESPACE':<15}{'COMMAND':<15}"]
        for i, pid in enumerate(clients, start=1):
            rows.append(f"{pid:<10}{i:<10}{server:<15}{state.uuid[:22]:<26}{4026531836:<15}{sys.executable}")
        return "\n".join(rows)
    if cmd == "get_device_client_list":
        clients = state.live_clients()
        if state.server_pid() is None or not clients:
            return ""
        return "\n".join(["[0] 00:00.0, Fake H100", *(f"{pid}.1" for pid in clients)])
    if cmd == "set_default_active_thread_percentage":
        # The real daemon answers an invalid value with the unchanged setting (logging why).
        value = args[0] if len(args) == 1 else ""
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not 0 < number <= 100:
            state.log("Invalid percentage, expected between (0.0, 100.0]")
            return state.default_atp
        state.default_atp = f"{number:.1f}"
        return state.default_atp
    if cmd == "get_default_active_thread_percentage":
        return state.default_atp
    if cmd == "get_active_thread_percentage":
        if len(args) != 1 or not is_server(state, args[0]):
            return f"Server {args[0] if args else ''} not found"
        return state.server_atp
    if cmd == "set_default_device_pinned_mem_limit":
        # Recorded: the real daemon accepts any unit silently ("12Q" is stored as 12M).
        if len(args) != 2:
            return f'Invalid arguments for "{cmd}"'
        digits = "".join(c for c in args[1] if c.isdigit()) or "0"
        stored = digits + ("G" if args[1].upper().endswith("G") else "M")
        if stored.endswith("M") and int(digits) >= 1024:  # recorded on the H100: 19981M is stored as 19G
            stored = f"{int(digits) // 1024}G"
        state.default_mem[args[0]] = stored
        state.log(f"{cmd} {args[0]} {args[1]}.")
        return ""
    if cmd == "get_default_device_pinned_mem_limit":
        if len(args) != 1:
            return f'Invalid arguments for "{cmd}"'
        return state.default_mem.get(args[0], "0")
    if cmd == "get_device_pinned_mem_limit":
        if len(args) != 2 or not is_server(state, args[0]):
            return f"Server {args[0] if args else ''} not found"
        return state.server_mem.get(args[1], "0")
    if cmd == "get_default_client_priority":
        return state.default_priority
    if cmd == "set_default_client_priority":
        if args not in (["0"], ["1"]):
            return f'Invalid arguments for "{cmd}"'
        state.default_priority = args[0]
        return ""
    if cmd == "terminate_client":
        if len(args) != 2 or not is_server(state, args[0]):
            server = args[0] if args else ""
            return f"Server {server} not found\nServer {server} not found!\n1"
        client = int(args[1]) if args[1].isdigit() else -1
        if client not in state.live_clients():
            return f"Invalid process {args[1]}!\n1"
        state.clients[client] = "terminated"
        state.changed.notify_all()
        state.server_log(f"MPS server requesting client {{PID: {client}, Context ID: 1}} to exit")
        state.server_log("Client termination succeeded.")
        return "0"
    if cmd == "__client_attach":
        # Fake CUDA init: a client attaches (hold_client keeps its connection); the server starts lazily, as the real one does.
        if state.quitting:
            return "refused"
        pid = int(args[0])
        uuid = args[1] if len(args) > 1 else state.uuid  # the device the client chose
        if uuid not in state.uuids:
            return "nodevice"
        server = state.ensure_server()
        if len(state.live_clients()) >= int(os.environ.get("FAKE_MPS_MAX_CLIENTS", "48")):
            # Recorded on the H100 (driver 580) for the 49th client.
            state.server_log(f"Failed to accept new client. Maximum number of clients ({len(state.clients)}) reached.")
            return "busy"
        queues = int(args[2]) if len(args) > 2 and args[2].isdigit() else 2
        taken = sum(count for client, (gpu, count) in state.queues.items() if gpu == uuid and client in state.clients)
        if taken + queues > GPU_QUEUES:  # measured on the H100: that client's cudaSetDevice fails, out of memory
            return "noqueues"
        state.clients[pid] = "ok"
        state.queues[pid] = (uuid, queues)
        # The lines the real daemon writes for every connection (tests/data/h100/daemon_stdout.txt).
        state.log(f"NEW CLIENT {pid} from user {os.getuid()}: Server already exists")
        state.server_log(f"Client {{PID: {pid}, Context ID: 0}} connected")
        return f"ok {server} {uuid}"
    if cmd == "__client_fault":
        # One client's fatal GPU error tears down every client of the server (Volta+ MPS).
        pid = int(args[0])
        server = state.server_pid()
        # Recorded on the H100: every client is torn down, the server stays ACTIVE.
        for client in state.clients:
            state.clients[client] = "fault"
        state.changed.notify_all()
        state.server_log(f"Client {{PID: {pid}, Context: 1}} encountered a fatal GPU error.")
        state.server_log("Server is handling a fatal GPU error.")
        for client in sorted(state.clients):
            state.server_log(f"Client {{PID: {client}, Context ID: 1}} on device 0 to be torn down")
        for client in sorted(state.clients):
            state.server_log(f"All clients belonging to error trigging process {client} will be torn down")
        state.server_log("The following client process have a sticky error set:")
        for client in sorted(state.clients):
            state.server_log(str(client))
        del server
        return "ok"
    return f'Unknown command "{cmd}"'


def run_daemon() -> int:
    if os.environ.get("FAKE_MPS_START_FAIL"):
        print("An instance of this daemon is already running", flush=True)
        return 1
    directory = pipe_dir()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "nvidia-cuda-mps-control.pid"), "w") as pid_file:
        pid_file.write(f"{os.getpid()}\n")
    open(os.path.join(directory, "control_lock"), "a").close()
    if os.environ.get("FAKE_MPS_NO_ANSWER"):
        while True:
            time.sleep(1)
    time.sleep(float(os.environ.get("FAKE_MPS_ANSWER_AFTER", "0")))
    state = State()
    if os.environ.get("FAKE_MPS_QUIT_HANG"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    done = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline().decode().strip()
            if line.startswith("__client_attach"):
                return hold_client(state, line, self.wfile.write)
            reply, stop = handle(state, line)
            self.wfile.write(reply.encode())
            if stop:
                done.set()

    for name in ("control", "control_privileged"):
        if os.path.lexists(os.path.join(directory, name)):
            os.unlink(os.path.join(directory, name))
    server = _Listener(os.path.join(directory, "control"), Handler)
    server.daemon_threads = True
    privileged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    privileged.bind(os.path.join(directory, "control_privileged"))
    state.log("Starting control daemon using socket " + os.path.join(directory, "control"))
    state.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={directory}")
    state.log("CUDA MPS Control binary version: 13000 (fake)")
    # A short poll interval: the real daemon exits about 170 ms after quit (recorded), not 0.5 s.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    done.wait()
    server.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        return run_client()
    if argv[0] == "--server":
        return run_server(argv[1])  # fake_mps_client's (the daemon starts that file)
    if argv[0] == "-f":
        return run_daemon()
    if argv[0] in ("-h", "--help"):
        print(recorded_reply("-h"), end="")
        return 0
    if argv[0] == "-d":
        print("the fake daemon supports only -f", file=sys.stderr)
        return 2
    print(f'Unrecognized option "{argv[0]}"')
    print(recorded_reply("-h"), end="")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
