"""A session's variables in ``os.environ``: set for its duration, restored after, one thread at a time.

``os.environ`` belongs to the whole process. Sessions nest (an inner ``with`` sets its own
values and gives the outer ones back), but two sessions of different threads cannot share it:
whichever closed first would restore values under the other. The second is refused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from mpsrun.errors import ConfigError

__all__ = ["Export"]

_lock = threading.Lock()
_active: list[Export] = []  # innermost last


class Export:
    thread: threading.Thread

    def __init__(self, names: Sequence[str], env: Mapping[str, str], drop_others: bool) -> None:
        """Set ``env`` in ``os.environ``; the other ``names`` are removed when ``drop_others`` (stale MPS settings)."""
        with _lock:
            owner = _active[-1].thread if _active else None
            if owner is not None and owner is not threading.current_thread():
                raise ConfigError(
                    "another thread's session has its variables in os.environ; pass export=False and give "
                    "workers session.env()", setting="export")
            self.thread = threading.current_thread()
            self.saved = {name: os.environ.get(name) for name in names}
            _active.append(self)
        for name in names:
            if name in env:
                os.environ[name] = env[name]
            elif drop_others:
                os.environ.pop(name, None)

    def restore(self) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
