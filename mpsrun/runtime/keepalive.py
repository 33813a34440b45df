"""Links between hosts that notice a peer gone without a word (see ``mpsrun.runtime.constants.LINK_IDLE``).

Standard library only.
"""

from __future__ import annotations

import contextlib
import socket

from mpsrun.runtime.constants import LINK_IDLE, LINK_LOST_AFTER, LINK_PROBE_EVERY, LINK_PROBES

__all__ = ["keep_alive"]


def keep_alive(sock: socket.socket) -> None:
    """Have the kernel notice a peer host that is gone without a word (see ``LINK_IDLE``); TCP links only."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(AttributeError, OSError):  # the TCP names are Linux's; elsewhere the system's defaults
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, LINK_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, LINK_PROBE_EVERY)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, LINK_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(LINK_LOST_AFTER * 1000))
