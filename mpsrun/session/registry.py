"""This user's sessions on this node: ``mpsrun status``, ``mpsrun cleanup``, and the reaper's work.

Every session directory holds ``session.json`` (:mod:`mpsrun.session.record`): its owner, its
daemons and its local ranks, each by pid and start time. A session whose owner is gone is
stale. :func:`reap` ends what a stale session's record names (daemons by ``quit`` then by
signals to their verified process group, rank process groups by SIGKILL) and removes the
directory; never by name, never another user's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from mpsrun.config.commandline import OneLineParser
from mpsrun.errors import DaemonError, MPSError, MPSUnavailableError, RecordError
from mpsrun.exitcodes import ExitCode
from mpsrun.mps.daemon import CONTROL_EXECUTABLE, find_control_executable
from mpsrun.runtime.constants import SESSION_DIR_VARIABLE
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.files import remove_tree
from mpsrun.runtime.output import clipped, printable, say
from mpsrun.runtime.processes import ProcessRef
from mpsrun.session.paths import RECORD_FILE, base_directory, user_root, user_root_lock
from mpsrun.session.record import DaemonRecord, SessionRecord
from mpsrun.session.reservation import RESERVATION

__all__ = ["SessionState", "SessionUsers", "cleanup", "list_sessions", "main", "reap"]

#: A directory without a record is a session still being made for this long.
_GRACE_WITHOUT_RECORD = 60.0


class SessionUsers:
    """This user's live processes by the session directory they use (their MPS pipe directory, or their
    MPSRUN_SESSION_DIR, lies in it): what proves that nothing of a session without a record still runs. The process
    table is scanned once, when first asked, for every directory of one listing: a rank can make thousands of
    directories without a record."""

    def __init__(self) -> None:
        self._used: dict[str, set[int]] | None = None

    def of(self, root: Path) -> list[int]:
        """The processes that use ``root``: it is, or holds, a directory they name."""
        if self._used is None:
            self._used = _scan_users()
        prefix = f"{root}/"
        return sorted({pid for path, pids in self._used.items() if path == str(root) or path.startswith(prefix)
                       for pid in pids})


def _scan_users() -> dict[str, set[int]]:
    import psutil  # rarely needed: not imported on every job's path

    used: dict[str, set[int]] = {}
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"].real != os.getuid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
        except (psutil.Error, AttributeError):
            continue
        for name in ("CUDA_MPS_PIPE_DIRECTORY", SESSION_DIR_VARIABLE):
            if env.get(name):
                used.setdefault(os.path.normpath(env[name]), set()).add(proc.pid)
    return used


class SessionState(NamedTuple):
    """A session directory as found: its record (None: ``problem`` says why), and who uses the sessions."""

    root: Path
    record: SessionRecord | None
    users: SessionUsers
    problem: str = ""  # why there is no record

    @property
    def session_id(self) -> str:
        return self.root.name

    @property
    def owner_alive(self) -> bool:
        if self.root.is_symlink():
            return False
        if self.record is None:  # still being made, or something of it still runs
            with contextlib.suppress(OSError):
                if time.time() - self.root.stat().st_mtime < _GRACE_WITHOUT_RECORD:
                    return True
            return bool(self.users.of(self.root))
        return self.record.owner.alive()

    @property
    def stale(self) -> bool:
        return not self.owner_alive

    @property
    def kept(self) -> bool:
        """Logs kept on request (``--keep-logs``): its owner is gone and nothing of it runs."""
        record = self.record
        return record is not None and record.keep_logs and self.stale and not any(
            d.process.alive() for d in record.daemons)

    @property
    def age(self) -> float:
        if self.record is not None:
            return time.time() - self.record.started
        with contextlib.suppress(OSError):
            return time.time() - self.root.stat().st_mtime
        return 0.0


def read_state(root: Path, users: SessionUsers | None = None) -> SessionState:
    """The session at ``root``; ``users``: the scan of the processes that use session directories, shared by the
    directories of one listing."""
    users = users or SessionUsers()
    if root.is_symlink():
        return SessionState(root, None, users, "a symbolic link, not a session directory")
    try:
        return SessionState(root, SessionRecord.read(root / RECORD_FILE), users)
    except RecordError as exc:
        return SessionState(root, None, users, f"unreadable record: {exc}")


def list_sessions(base: Path | None = None) -> list[SessionState]:
    """This user's session directories under ``base`` (default: where new sessions go)."""
    root = user_root(base or base_directory())
    try:
        if not root.is_dir() or root.is_symlink() or root.stat().st_uid != os.getuid():
            return []  # only ever our own sessions
        entries = sorted(root.iterdir())
    except OSError:  # e.g. a base directory we may not enter: then we have no sessions there
        return []
    users = SessionUsers()
    return [read_state(entry, users) for entry in entries if entry.is_dir() or entry.is_symlink()]


def _ours(process: ProcessRef) -> bool:
    """Whether ``process`` runs, as this user: a record (which a rank can write) may name anyone's process, and root
    could signal it."""
    try:
        return process.alive() and os.stat(f"/proc/{process.pid}").st_uid == os.getuid()
    except OSError:
        return False


def _serving(entry: DaemonRecord) -> bool:
    """Whether the record's daemon runs, as this user, for the record's pipe directory (mpsrun starts each daemon
    with it in its environment): a record may name any process, and each would cost a quit's timeout."""
    if not _ours(entry.process):
        return False
    try:
        with open(f"/proc/{entry.process.pid}/environ", "rb") as stream:
            variables = stream.read().split(b"\0")
    except OSError:
        return False
    return b"CUDA_MPS_PIPE_DIRECTORY=" + os.fsencode(entry.pipe_dir) in variables


def _stop_daemons(record: SessionRecord, deadline: Deadline) -> int:
    """Stop the record's daemons that are this user's, within ``deadline``; how many of them stopped."""
    try:
        executable = find_control_executable()
    except MPSUnavailableError:
        executable = CONTROL_EXECUTABLE
    stopped = 0
    for entry in record.daemons:
        if _serving(entry):
            with contextlib.suppress(DaemonError):
                entry.daemon(executable).stop(timeout=deadline.cap(5.0), grace=deadline.cap(2.0))
            stopped += not entry.process.alive()
    return stopped


def _owned_by(state: SessionState, pid: int) -> bool:
    """Whether the session at ``state.root`` is still the one process ``pid`` owned: a node session's fixed name
    may have been reserved (a reservation and no record) or claimed (a record of another owner) again since."""
    if state.record is not None:
        return state.record.owner.pid == pid
    return not (state.root / RESERVATION).exists()


def reap(root: Path, force: bool = False, keep_logs: bool | None = None, lock_timeout: float = 60.0,
         locked: bool = False, owner: int | None = None, users: SessionUsers | None = None,
         deadline: Deadline | None = None) -> str | None:
    """End what a session whose owner is gone left behind, and remove it; what was done, or None.

    A live owner's session is left alone unless ``force``; with ``owner``, so is a session that is no
    longer that process's. Runs under the user's lock (taken here unless the caller holds it:
    ``locked``), so the reaper, ``cleanup``, node keepers and new sessions never work on one
    directory at once. ``users``: a listing's scan of the processes that use session directories; ``deadline``:
    what the daemons' stop may take at most (a stop cut short still signals them).
    """
    lock = contextlib.nullcontext() if locked else user_root_lock(root.parent.parent, lock_timeout)
    with lock:
        if root.is_symlink():  # not one of ours to follow: only the link goes
            root.unlink()
            return "removed (a symbolic link)"
        if not root.is_dir():
            return None
        state = read_state(root, users)
        if owner is not None and not _owned_by(state, owner):
            return None
        record = state.record
        if not force and record is not None:
            poll_until(lambda: (not record.owner.alive()) or None, Deadline(5.0))  # a dying owner
        forced = state.owner_alive
        if forced and not force:
            return None
        stopped = _stop_daemons(record, deadline or Deadline(None)) if record is not None else 0
        for group in (*record.ranks, *record.launchers) if record is not None else ():
            if _ours(group):
                group.signal_group(signal.SIGKILL)
        keep = record.keep_logs if keep_logs is None and record is not None else bool(keep_logs)
        done = "kept" if keep else "removed"
        if not keep:
            try:
                remove_tree(root)
            except OSError as exc:  # (said: the directory is still there)
                where = f": {printable(str(exc.filename))}" if exc.filename else ""
                done = f"not removed ({exc.strerror or exc}{where})"
    whose = f"owner {record.owner.pid}" if record is not None else f"no record ({state.problem})"
    return f"{done} ({'forced, ' if forced else ''}{whose}, {stopped} daemon(s) stopped)"


def cleanup(base: Path | None = None, force: Sequence[str] = (), dry_run: bool = False,
            lock_timeout: float = 60.0, remove_kept: bool = True,
            deadline: Deadline | None = None) -> list[tuple[str, str]]:
    """Stop and remove stale sessions (and those named in ``force``); return (session, what was done).

    Kept logs are removed only when asked (``mpsrun cleanup``), never by a new session. With ``deadline``, what is
    left when it passes is left for later.
    """
    done = []
    for state in list_sessions(base):
        if deadline is not None and deadline.expired():
            break
        named = state.session_id in force
        if (not state.stale and not named) or (state.kept and not remove_kept):
            continue
        if dry_run:
            done.append((state.session_id, "would remove"))
            continue
        what = reap(state.root, force=named, keep_logs=False, lock_timeout=lock_timeout, users=state.users,
                    deadline=deadline)
        if what is not None:
            done.append((state.session_id, what))
    return done


def _age(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _as_json(state: SessionState) -> dict[str, object]:
    record = state.record
    return {
        "session": state.session_id,
        "directory": str(state.root),
        "kind": record.kind if record else None,
        "owner_pid": record.owner.pid if record else None,
        "owner_alive": state.owner_alive,
        "age_s": round(state.age, 1),
        "stale": state.stale,
        "kept": state.kept,
        "problem": state.problem or None,
        "daemons": [{"gpu": d.gpu, "pid": d.process.pid, "alive": d.process.alive()} for d in record.daemons]
        if record
        else [],
        "ranks": [r.pid for r in record.ranks if r.alive()] if record else [],
    }


#: The most characters of a status row's daemons (a record may name thousands).
_CELL_MOST = 120


def _print_status(states: Sequence[SessionState]) -> None:
    if not states:
        print("mpsrun status: no sessions")
        return
    print(f"{'SESSION':<11} {'KIND':<5} {'OWNER':<14} {'AGE':>7}  {'DAEMONS (pid state)':<28} DIRECTORY")
    for state in states:
        record = state.record
        owner = f"{record.owner.pid} {'alive' if state.owner_alive else 'KEPT' if state.kept else 'GONE'}" \
            if record else "unreadable"
        daemons = "; ".join(f"{d.process.pid} {'up' if d.process.alive() else 'gone'}" for d in record.daemons) \
            if record else state.problem
        kind = record.kind if record else "?"
        print(f"{printable(state.session_id):<11} {kind:<5} {owner:<14} {_age(state.age):>7}  "
              f"{clipped(printable(daemons), _CELL_MOST) or '-':<28} {printable(str(state.root))}")
    stale = sum(state.stale and not state.kept for state in states)
    if stale:
        print(f"{stale} stale session(s): run `mpsrun cleanup`")
    kept = sum(state.kept for state in states)
    if kept:
        print(f"{kept} session(s) with kept logs: `mpsrun cleanup` removes them")


def main(argv: Sequence[str], command: str) -> int:
    parser = OneLineParser(prog=f"mpsrun {command}")
    parser.add_argument("--tmpdir", type=Path, default=None, help="where sessions live (default as for new ones)")
    if command == "status":
        parser.description = "List this user's mpsrun sessions on this node."
        parser.add_argument("--json", action="store_true", help="print JSON")
    else:
        parser.description = "Stop and remove this user's stale sessions (owner gone); never another user's."
        parser.add_argument("--force", action="append", default=[], metavar="SESSION",
                            help="also stop and remove this live session (repeatable)")
        parser.add_argument("--dry-run", action="store_true", help="say what would be done")
    args = parser.parse_args(argv)
    if command == "cleanup":
        unknown = set(args.force) - {s.session_id for s in list_sessions(args.tmpdir)}
        if unknown:
            say(f"mpsrun cleanup: error: no session {', '.join(sorted(unknown))} of yours here")
            return ExitCode.USAGE
        try:
            done = cleanup(args.tmpdir, args.force, args.dry_run)
        except MPSError as exc:
            say(f"mpsrun cleanup: error: {exc}")
            return exc.exit_code
        for session, what in done:
            print(f"{printable(session)}: {printable(what)}")
        if not done:
            print("mpsrun cleanup: nothing to clean up")
        return ExitCode.OK
    states = list_sessions(args.tmpdir)
    if args.json:
        print(json.dumps([_as_json(s) for s in states], indent=1))
    else:
        _print_status(states)
    return ExitCode.OK
