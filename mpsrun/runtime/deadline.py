"""The one deadline and poll helper: every wait in mpsrun has a deadline, nothing sleeps blind."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["Deadline", "backoff", "poll_until"]

T = TypeVar("T")


class Deadline:
    """A point in monotonic time; ``Deadline(None)`` never expires."""

    def __init__(self, seconds: float | None, since: float | None = None) -> None:
        """``seconds`` from now, or from ``since`` (``time.monotonic()``: the clock is the machine's, so another
        process's start counts too)."""
        self.seconds = seconds
        self.at = math.inf if seconds is None else (time.monotonic() if since is None else since) + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def cap(self, seconds: float) -> float:
        """``seconds``, or less when the deadline comes first."""
        return min(seconds, self.remaining())


def backoff(first: float = 0.002, factor: float = 1.5, cap: float = 0.05) -> Iterator[float]:
    """Poll intervals: short at first (most waits end within milliseconds), then ``cap``."""
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * factor)


def poll_until(check: Callable[[], T | None], deadline: Deadline, cap: float = 0.05) -> T | None:
    """Call ``check`` until it returns something other than None, or the deadline passes (None).

    ``check`` runs at least once. The interval between calls is a bounded poll interval,
    never longer than what is left of the deadline.
    """
    for delay in backoff(cap=cap):
        result = check()
        if result is not None or deadline.expired():
            return result
        time.sleep(deadline.cap(delay))
    raise AssertionError("unreachable")  # pragma: no cover
