"""The fake ``nvidia-cuda-mps-control`` as a client: one command per stdin line to the fake daemon's socket.

Kept apart from fake_mps_control.py (the daemon) so that a command, run as its own process as mpsrun runs
the real client, starts on the built-in modules alone: the real client is a small C program, and the
tests run thousands of commands. Any option (``-f``, ``--server``, ``-h``) goes to fake_mps_control.
"""

from __future__ import annotations

import os
import socket
import sys

NO_DAEMON = "Cannot find MPS control daemon process"


def pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def send(command: str, directory: os.PathLike[str] | str | None = None, timeout: float | None = None) -> str | None:
    """Send one command to the daemon; None when no daemon answers."""
    path = os.path.join(os.fspath(directory or pipe_dir()), "control")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    with conn:
        conn.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def run_client() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = send(line.strip())
        if reply is None:
            print(NO_DAEMON, file=sys.stderr)
            return 1
        if reply:
            print(reply, flush=True)
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        return run_client()
    from fake_mps_control import main as daemon_main

    return daemon_main(argv)
