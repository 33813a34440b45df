"""The fake ``nvidia-cuda-mps-control`` as a client, and the fake MPS server: the short-lived processes.

Kept apart from fake_mps_control.py (the daemon) so that a command, run as its own process as mpsrun runs
the real client, starts on the built-in modules alone: the real client is a small C program, and the
tests run thousands of commands (and start a server per session). Hence ``_socket``, the C module under
``socket``, whose import (enum and more) costs more than the command. Any other option (``-f``, ``-h``)
goes to fake_mps_control.
"""

from __future__ import annotations

import _socket
import os
import sys

NO_DAEMON = "Cannot find MPS control daemon process"


def pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def send(command: str, directory: os.PathLike[str] | str | None = None, timeout: float | None = None) -> str | None:
    """Send one command to the daemon; None when no daemon answers."""
    path = os.path.join(os.fspath(directory or pipe_dir()), "control")
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        try:
            conn.connect(path)
        except OSError:
            return None
        conn.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    finally:
        conn.close()
    return b"".join(chunks).decode()


def attach(command: str, directory: str, timeout: float) -> tuple[str | None, _socket.socket | None, bytes]:
    """Send ``command`` and keep the connection: the daemon's first line is the reply, a later one its news for this
    client (a real client learns of its end from its server, not by asking the control daemon). Returns the reply,
    the connection (None when no daemon answers) and any bytes read past the reply's line."""
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(os.path.join(directory, "control"))
        conn.sendall(command.encode() + b"\n")
        received = b""
        while b"\n" not in received and (chunk := conn.recv(65536)):
            received += chunk
    except OSError:
        conn.close()
        return None, None, b""
    reply, _, rest = received.partition(b"\n")
    conn.setblocking(False)
    return reply.decode(), conn, rest


def run_client() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        if line.strip() == "quit" and os.environ.get("FAKE_MPS_QUIT_CLIENT_WAIT"):  # a client slow to start
            import time  # only here: the module is built in, and most commands do not wait

            time.sleep(float(os.environ["FAKE_MPS_QUIT_CLIENT_WAIT"]))
        reply = send(line.strip())
        if reply is None:
            print(NO_DAEMON, file=sys.stderr)
            return 1
        if reply:
            print(reply, flush=True)
    return 0


def run_server(uuid: str) -> int:
    """The fake MPS server: shows up in the fake NVML as a compute process, dies with the daemon (its stdin ends)."""
    nvml_dir = os.environ.get("MPSRUN_FAKE_NVML")
    entry = os.path.join(nvml_dir, "procs", str(os.getpid())) if nvml_dir else None
    if entry is not None:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        with open(entry, "w") as record:
            record.write(f'{{"uuid": "{uuid}", "type": "C", "mib": 66}}')  # JSON, without importing json
    try:
        while os.read(0, 65536):  # EOF when the daemon exits or stops us
            pass
    finally:
        if entry is not None:
            try:  # noqa: SIM105 - contextlib's import would cost more than this process's work
                os.unlink(entry)
            except FileNotFoundError:
                pass
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        return run_client()
    if argv[0] == "--server":
        return run_server(argv[1])
    from fake_mps_control import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":  # the daemon starts its server so
    sys.exit(main(sys.argv[1:]))
