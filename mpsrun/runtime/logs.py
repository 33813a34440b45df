"""mpsrun's log: the ``mpsrun`` logger of :mod:`logging`, or, in the ``mpsrun`` command, its own lines on stderr.

Used as a library (:func:`mpsrun.mps_session`), mpsrun logs to ``logging.getLogger("mpsrun")`` and the
program's logging configuration decides what is shown. The ``mpsrun`` command shows its warnings
(and with ``-v`` its progress) as plain lines; it calls :func:`to_stderr` and never imports
``logging``, whose import (7 ms on the H100 machine) would otherwise come before every job's start.
"""

from __future__ import annotations

from mpsrun.runtime.output import say

__all__ = ["DEBUG", "ERROR", "INFO", "WARNING", "Log", "to_stderr"]

DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40  # logging's levels

_stderr_level: int | None = None  # set by the command: its lines go to stderr, not through logging


def to_stderr(level: int) -> None:
    """From now on, this process's messages at ``level`` and above are written to stderr, one line each."""
    global _stderr_level
    _stderr_level = level


class Log:
    """The ``logging.Logger`` methods mpsrun uses, for the logger ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, message: str, *args: object) -> None:
        self._log(DEBUG, message, args)

    def info(self, message: str, *args: object) -> None:
        self._log(INFO, message, args)

    def warning(self, message: str, *args: object) -> None:
        self._log(WARNING, message, args)

    def error(self, message: str, *args: object) -> None:
        self._log(ERROR, message, args)

    def _log(self, level: int, message: str, args: tuple[object, ...]) -> None:
        if _stderr_level is not None:
            if level >= _stderr_level:
                say(message % args if args else message)
            return
        import logging

        logging.getLogger(self.name).log(level, message, *args)
