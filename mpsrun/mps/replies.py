"""What the MPS control program says: its replies and its log, parsed. Pure functions, no I/O.

Every format here was recorded from the real ``nvidia-cuda-mps-control`` on an H100
(tests/data/h100/). The control client exits 0 even when a command fails, so replies
are recognised by their text.
"""

from __future__ import annotations

import enum
import re

__all__ = [
    "NO_DAEMON",
    "ServerStatus",
    "connected_clients",
    "diagnose_log",
    "is_error_reply",
    "parse_pid_list",
    "parse_server_status",
    "reply_mib",
    "reply_number",
    "started_servers",
    "torn_down_clients",
]

NO_DAEMON = "Cannot find MPS control daemon process"
# Replies the daemon prints instead of a result when a command fails (rc stays 0).
_ERROR_REPLY = re.compile(
    r"^(Unknown command|Invalid|Incorrect|Usage|Not enough privilege|Server \d+ not found|.*\bnot found\b"
    r"|.*\b[Ee]rror\b|.*\bfailed\b)"
)


def is_error_reply(reply: str) -> bool:
    """Whether a reply's first line says the command failed."""
    first = reply.splitlines()[0] if reply else ""
    return bool(_ERROR_REPLY.match(first))


class ServerStatus(enum.Enum):
    """States an MPS server reports through ``get_server_status``."""

    INITIALIZING = "INITIALIZING"
    ACTIVE = "ACTIVE"
    FAULT = "FAULT"


def parse_pid_list(reply: str) -> list[int]:
    """PIDs printed one per line (``get_server_list``, ``get_client_list``)."""
    return [int(line) for line in reply.split() if line.isdigit()]


def reply_number(reply: str) -> float | None:
    """A number the daemon printed (``50.0``), or None if the reply is not one."""
    try:
        return float(reply)
    except ValueError:
        return None


def reply_mib(reply: str) -> float | None:
    """A memory limit as the daemon prints it (``4G``, ``1536M``) in MiB; None if it is neither."""
    unit = reply.strip()[-1:].upper()
    number = reply_number(reply.strip()[:-1])
    if number is None or unit not in ("M", "G"):
        return None
    return number * (1024 if unit == "G" else 1)


def parse_server_status(reply: str) -> ServerStatus:
    """The state in a ``get_server_status`` reply; raise :class:`ValueError` otherwise."""
    return ServerStatus(reply.strip())


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


_CONNECTED = re.compile(r"Client \{PID: (\d+), Context ID: \d+\} connected")


def connected_clients(text: str) -> list[int]:
    """PIDs of the clients a server accepted, in order, from its log (``-f`` writes every connection).

    Recorded on an H100: ``NEW CLIENT <pid> from user <uid>: ...`` from the control daemon, then
    ``Client {PID: <pid>, Context ID: <n>} connected`` from the server. Only the server's line is
    proof: the control daemon also logs clients the server then refuses (the 49th).
    """
    return [int(pid) for pid in _CONNECTED.findall(text)]


_STARTING = re.compile(r"Starting new server (\d+) for user \d+")


def started_servers(text: str) -> list[int]:
    """PIDs of the servers a control daemon started, from its log: ``Starting new server <pid> for user <uid>``
    (recorded on an H100, for ``start_server`` and for a server started by its first client alike)."""
    return [int(pid) for pid in _STARTING.findall(text)]
