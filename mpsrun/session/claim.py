"""A session's claim: its reaper, its private directory and its record, made before anything of it starts.

The reaper comes first, for the directory to come: from the moment the directory exists, a
SIGKILL of its owner leaves nothing behind (the reaper stops what the record names by then
and removes the directory). A session makes its claim when it starts; the ``mpsrun`` launcher
makes it earlier, before the session's GPUs are read, because under the mpiexec launcher the
job's control socket (in this directory) must exist before mpiexec starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mpsrun.errors import InterruptionError, MPSError
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import uninterrupted
from mpsrun.runtime.output import printable
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import SessionDirs, new_session_name, user_root
from mpsrun.session.reaper import Reaper
from mpsrun.session.record import SessionRecord
from mpsrun.session.reservation import claim_reserved

__all__ = ["SessionClaim"]

log = logging.getLogger("mpsrun")

#: Seconds a new session spends at most on what killed earlier runs left (a stale daemon answers quit in
#: milliseconds).
STALE_REMOVAL_BUDGET = 1.0


def _remove_stale(base: Path) -> None:
    """Best effort, never waiting long: stop and remove what a killed earlier run of this user left, within
    STALE_REMOVAL_BUDGET (a rank can plant records by the thousand; what is left waits for ``mpsrun cleanup``)."""
    try:
        if any(os.scandir(user_root(base))):  # nothing there, nothing to read (nor to import)
            from mpsrun.session import registry

            for session_id, what in registry.cleanup(base, lock_timeout=0, remove_kept=False,
                                                     deadline=Deadline(STALE_REMOVAL_BUDGET)):
                log.info("mpsrun: stale session %s %s", printable(session_id), what)
    except InterruptionError:  # a stopping signal stops the start-up (swallowed, every later one was only noted)
        raise
    except Exception as exc:  # best effort: whatever earlier runs left cannot stop this one
        log.debug("mpsrun: stale sessions not removed: %r", exc)


def _undo(dirs: SessionDirs | None, reaper: Reaper | None) -> None:
    """What a claim that could not be made had made of itself, removed."""
    if dirs is not None:
        with contextlib.suppress(OSError):
            dirs.remove()
    if reaper is not None:
        reaper.release()


class SessionClaim:
    """A session's directory (``dirs``), its record (``record``, rewritten by :meth:`update`) and its reaper. Make
    one with :meth:`make`."""

    def __init__(self, dirs: SessionDirs, record: SessionRecord, reaper: Reaper, keep_logs: bool) -> None:
        self.dirs: SessionDirs | None = dirs  # kept after release(): what it was, for a last word about it
        self.record = record
        self.keep_logs = keep_logs
        self._reaper: Reaper | None = reaper
        self._released = False

    @classmethod
    def make(cls, base: Path, kind: str, name: str | None = None, keep_logs: bool = False,
             reservation: str | None = None) -> SessionClaim:
        """Claim a session under ``base``, after removing what a killed earlier run of this user left there.

        ``kind``: ``api``, ``job`` or ``node`` (see :mod:`mpsrun.session.record`); ``name``: a fixed name (a node
        session's, which every local rank computes), else a fresh random one; ``reservation``: the token of the
        directory the node's starting rank made for us (:mod:`mpsrun.session.reservation`).
        """
        _remove_stale(base)
        reaper: Reaper | None = None
        dirs: SessionDirs | None = None
        try:
            name = name or new_session_name(base)
            with uninterrupted():  # first, for the path to come: a SIGKILL from here on leaves nothing behind
                reaper = Reaper(user_root(base) / name)
            record = SessionRecord.new(kind, argv=tuple(sys.argv), keep_logs=keep_logs)
            if reservation is None:
                dirs = SessionDirs.create(base, [], name=name)
                record.write(dirs.record_file)
            else:
                dirs = claim_reserved(base, name, reservation, record)
            return cls(dirs, record, reaper, keep_logs)
        except BaseException as exc:
            _undo(dirs, reaper)
            if isinstance(exc, OSError) and not isinstance(exc, MPSError):  # the machine's refusal (no space left)
                raise MPSError(f"cannot make a session directory under {base}: {exc.strerror or exc}") from None
            raise

    def add_gpus(self, uuids: Sequence[str], dir_indices: list[int]) -> None:
        """The session's GPUs are known: their directories (by ``dir_indices``) and the record's GPU list."""
        assert self.dirs is not None
        try:
            self.dirs.add_gpus(dir_indices)
        except OSError as exc:
            raise MPSError(f"cannot make the GPUs' directories in {self.dirs.root}: {exc.strerror or exc}") from None
        self.update(self.record.with_gpus(tuple(uuids)))

    def add_launcher(self, pid: int) -> None:
        """Record the job's MPI launcher (its process group), for the reaper to end with the session."""
        launcher = ProcessRef.of(pid)
        if launcher is not None:
            self.update(self.record.with_launcher(launcher))

    def update(self, record: SessionRecord) -> None:
        """Write the record anew (MPSError when the machine refuses: no space left, say)."""
        assert self.dirs is not None
        self.record = record
        try:
            record.write(self.dirs.record_file)
        except OSError as exc:
            raise MPSError(f"cannot write {self.dirs.record_file}: {exc.strerror or exc}") from None

    def release(self, keep_logs: bool | None = None) -> list[BaseException]:
        """Remove the directory (unless its logs are kept: ``keep_logs``, by default as the claim was made) and
        tell the reaper; what could not be removed."""
        errors: list[BaseException] = []
        if self.dirs is not None and not self._released:
            if self.keep_logs if keep_logs is None else keep_logs:
                log.warning("mpsrun: kept session logs in %s", self.dirs.root)
            else:
                try:
                    self.dirs.remove()
                except OSError as exc:
                    errors.append(exc)
        self._released = True
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None
        return errors
