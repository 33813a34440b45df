"""``session.json``: the typed record of one session, so that whoever outlives its owner can clean up.

A session directory's record names its owner (the ``mpsrun`` of a job, a node keeper, or a
program using ``mps_session()``), each daemon, and the process groups of its local ranks,
every process by pid and start time. The session's reaper, the next session and
``mpsrun cleanup`` read it to stop what the owner left when it died.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mpsrun.errors import RecordError

if TYPE_CHECKING:  # the daemon's module (subprocess and all) is not needed to read or write a record
    from mpsrun.mps.daemon import ControlDaemon
from mpsrun.runtime.files import read_file, replace_file
from mpsrun.runtime.output import printable
from mpsrun.runtime.processes import ProcessRef

__all__ = ["KINDS", "RECORD_READ_LIMIT", "DaemonRecord", "SessionRecord"]

KINDS = ("api", "job", "node")
#: The largest record read: one names a session's daemons and local rank groups (a few hundred bytes each).
RECORD_READ_LIMIT = 1 << 24


class DaemonRecord(NamedTuple):
    """A daemon as a session's record names it, for whoever outlives its owner (the reaper, ``mpsrun cleanup``)."""

    gpu: str
    process: ProcessRef
    pipe_dir: str
    log_dir: str

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "process": self.process.to_json(), "pipe_dir": self.pipe_dir, "log_dir": self.log_dir}

    @classmethod
    def of(cls, daemon: ControlDaemon) -> DaemonRecord:
        assert daemon.process is not None, "the daemon has not been started"
        return cls(daemon.devices, daemon.process, str(daemon.pipe_dir), str(daemon.log_dir))

    def daemon(self, executable: str | None = None) -> ControlDaemon:
        """The daemon this names, to command or stop it (it may be another process's child)."""
        from mpsrun.mps.daemon import CONTROL_EXECUTABLE, ControlDaemon

        return ControlDaemon(self.gpu, Path(self.pipe_dir), Path(self.log_dir), executable or CONTROL_EXECUTABLE,
                             process=self.process)

    @classmethod
    def from_json(cls, data: Any) -> DaemonRecord:
        fields = ("gpu", "pipe_dir", "log_dir")
        if not isinstance(data, Mapping) or not all(isinstance(data.get(k), str) for k in fields):
            raise ValueError(f"not a daemon record: {data!r}")
        return cls(data["gpu"], ProcessRef.from_json(data.get("process")), data["pipe_dir"], data["log_dir"])


class SessionRecord(NamedTuple):
    kind: str
    owner: ProcessRef
    uid: int
    started: float
    gpus: tuple[str, ...] = ()
    daemons: tuple[DaemonRecord, ...] = ()
    ranks: tuple[ProcessRef, ...] = ()  # process groups of local ranks
    launchers: tuple[ProcessRef, ...] = ()  # process groups of the job's MPI launcher (mpiexec)
    argv: tuple[str, ...] = ()
    keep_logs: bool = False

    @classmethod
    def new(cls, kind: str, **fields: Any) -> SessionRecord:
        owner = ProcessRef.of(os.getpid())
        assert owner is not None
        return cls(kind=kind, owner=owner, uid=os.getuid(), started=time.time(), **fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "owner": self.owner.to_json(),
            "uid": self.uid,
            "started": self.started,
            "gpus": list(self.gpus),
            "daemons": [d.to_json() for d in self.daemons],
            "ranks": [r.to_json() for r in self.ranks],
            "launchers": [r.to_json() for r in self.launchers],
            "argv": list(self.argv),
            "keep_logs": self.keep_logs,
        }

    @classmethod
    def from_json(cls, data: Any) -> SessionRecord:
        try:
            if not isinstance(data, Mapping) or data.get("kind") not in KINDS:
                raise ValueError("no session kind")
            return cls(
                kind=data["kind"],
                owner=ProcessRef.from_json(data.get("owner")),
                uid=_typed(data.get("uid"), int),
                started=_moment(data.get("started")),
                gpus=tuple(_typed(g, str) for g in _typed(data.get("gpus", []), list)),
                daemons=tuple(DaemonRecord.from_json(d) for d in _typed(data.get("daemons", []), list)),
                ranks=tuple(ProcessRef.from_json(r) for r in _typed(data.get("ranks", []), list)),
                launchers=tuple(ProcessRef.from_json(r) for r in _typed(data.get("launchers", []), list)),
                argv=tuple(str(a) for a in _typed(data.get("argv", []), list)),
                keep_logs=bool(data.get("keep_logs", False)),
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise RecordError(f"not a session record: {exc}") from None

    @classmethod
    def read(cls, path: Path) -> SessionRecord:
        """The record at ``path``, read as a file a rank may have planted is (no link, FIFO or device; a bound)."""
        try:
            data = json.loads(read_file(path, RECORD_READ_LIMIT))
        except (OSError, ValueError, RecursionError) as exc:  # nested deeper than Python parses: not a record
            raise RecordError(f"cannot read {printable(str(path))}: {_reason(exc)}") from None
        return cls.from_json(data)

    def write(self, path: Path) -> None:
        """Replace the record atomically (a reader never sees half of one), through a new file of a random name: a
        rank can plant a FIFO at any name it can guess."""
        replace_file(path, json.dumps(self.to_json()).encode())

    def with_daemon(self, daemon: DaemonRecord) -> SessionRecord:
        return self._replace(daemons=(*self.daemons, daemon))

    def with_gpus(self, gpus: tuple[str, ...]) -> SessionRecord:
        return self._replace(gpus=gpus)

    def with_ranks(self, ranks: Sequence[ProcessRef], replacing: bool = False) -> SessionRecord:
        """The record with these ranks too (``replacing``: these alone, as a farm's running tasks change)."""
        return self._replace(ranks=tuple(ranks) if replacing else (*self.ranks, *ranks))

    def with_launcher(self, launcher: ProcessRef) -> SessionRecord:
        return self._replace(launchers=(*self.launchers, launcher))


def _reason(exc: BaseException) -> str:
    """Why a record could not be read, in words: an OSError's without its file name (said already)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return printable(str(exc)[:200])


def _moment(value: Any) -> float:
    """Seconds since the epoch, finite (JSON as Python reads it allows NaN and Infinity, and integers past floats)."""
    moment = float(_typed(value, (int, float)))
    if not math.isfinite(moment):
        raise ValueError(f"unexpected value {value!r}")
    return moment


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"unexpected value {value!r}")
    return value
