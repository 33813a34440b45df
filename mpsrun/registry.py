"""This user's sessions on this node: ``mpsrun status`` and ``mpsrun cleanup``.

Every session directory holds ``session.json``: the owning process (pid and start time)
and each GPU's daemon (pid and start time). A session whose owner is gone is stale (its
owner was SIGKILLed, or the node rebooted mid-job). Cleanup stops a stale session's
daemons, identified by pid AND start time AND uid (never by name, never another user's),
and removes the directory. A live session is left alone unless ``--force`` names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import psutil

from mpsrun.daemon import find_control_executable, parse_pid_list
from mpsrun.errors import MPSUnavailableError
from mpsrun.paths import base_directory, user_root

__all__ = ["DaemonRecord", "SessionRecord", "cleanup", "list_sessions", "main", "stop_daemon"]

#: A directory without session.json is a session still being made for this long.
_GRACE_WITHOUT_INFO = 60.0


def matching_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live, non-zombie process of ours with this pid and start time, if any."""
    if not pid or create_time is None:
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > 0.01 or proc.uids().real != os.getuid():
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


@attrs.frozen
class DaemonRecord:
    gpu: str
    pid: int
    create_time: float
    pipe_dir: Path
    alive: bool


@attrs.frozen
class SessionRecord:
    root: Path
    info: dict[str, Any]
    owner_alive: bool
    daemons: list[DaemonRecord]

    @property
    def session_id(self) -> str:
        return self.root.name

    @property
    def stale(self) -> bool:
        return not self.owner_alive

    @property
    def age(self) -> float:
        return time.time() - float(self.info.get("started", self.root.stat().st_mtime))


def _read(root: Path) -> SessionRecord | None:
    try:
        info = json.loads((root / "session.json").read_text())
    except (OSError, ValueError):
        try:
            young = time.time() - root.stat().st_mtime < _GRACE_WITHOUT_INFO
        except OSError:
            return None
        return SessionRecord(root, {}, owner_alive=young, daemons=[])
    owners = [(info.get("pid"), info.get("create_time"))]
    owners += [(h.get("pid"), h.get("create_time")) for h in info.get("holders", [])]  # per-node sessions
    owner = next((p for p in (matching_process(*o) for o in owners) if p is not None), None)
    daemons = [
        DaemonRecord(
            gpu=d.get("gpu", "?"),
            pid=int(d["pid"]),
            create_time=float(d["create_time"]),
            pipe_dir=Path(d["pipe_dir"]),
            alive=matching_process(d["pid"], d["create_time"]) is not None,
        )
        for d in info.get("daemons", [])
    ]
    return SessionRecord(root, info, owner_alive=owner is not None, daemons=daemons)


def list_sessions(base: Path | None = None) -> list[SessionRecord]:
    """This user's session directories under ``base`` (default: where new sessions go)."""
    root = user_root(base or base_directory())
    try:
        if not root.is_dir() or root.is_symlink() or root.stat().st_uid != os.getuid():
            return []  # only ever our own sessions
        entries = sorted(root.iterdir())
    except OSError:  # e.g. a base directory we may not enter: then we have no sessions there
        return []
    records = [_read(entry) for entry in entries if entry.is_dir() and not entry.is_symlink()]
    return [record for record in records if record is not None]


def stop_daemon(record: DaemonRecord, timeout: float = 5.0) -> None:
    """Stop a daemon we did not start ourselves: quit, then its process group, verified by start time."""
    proc = matching_process(record.pid, record.create_time)
    if proc is None:
        return
    with contextlib.suppress(MPSUnavailableError, OSError, subprocess.TimeoutExpired):
        subprocess.run(
            [find_control_executable()],
            input="quit\n",
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(record.pipe_dir)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            proc.wait(timeout=timeout if sig == signal.SIGTERM else 0.1)
            return
        except psutil.TimeoutExpired:
            pass
        except psutil.NoSuchProcess:
            return
        if matching_process(record.pid, record.create_time) is None:
            return
        # The daemon leads its own process group (its servers are in it): verified above by start time.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, sig)
    with contextlib.suppress(psutil.Error):
        proc.wait(timeout=timeout)


def cleanup(base: Path | None = None, force: Sequence[str] = (), dry_run: bool = False) -> list[tuple[str, str]]:
    """Stop and remove stale sessions (and those named in ``force``); return (session, what was done)."""
    done = []
    for record in list_sessions(base):
        forced = record.session_id in force
        if not record.stale and not forced:
            continue
        action = "would remove" if dry_run else "removed"
        alive = [d for d in record.daemons if d.alive]
        if not dry_run:
            for daemon in alive:
                stop_daemon(daemon)
            shutil.rmtree(record.root, ignore_errors=True)
        what = f"{action} ({'forced, ' if forced and not record.stale else ''}owner "
        what += f"{record.info.get('pid', '?')} {'alive' if record.owner_alive else 'gone'}"
        what += f", {len(alive)} daemon(s) stopped)" if alive and not dry_run else ")"
        done.append((record.session_id, what))
    return done


def _servers(daemon: DaemonRecord) -> str:
    if not daemon.alive:
        return "-"
    try:
        out = subprocess.run(
            [find_control_executable()],
            input="get_server_list\n",
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir)},
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (MPSUnavailableError, OSError, subprocess.TimeoutExpired):
        return "?"
    return ",".join(str(p) for p in parse_pid_list(out.stdout)) or "none"


def _age(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def main(argv: Sequence[str], command: str) -> int:
    parser = argparse.ArgumentParser(prog=f"mpsrun {command}")
    parser.add_argument("--tmpdir", type=Path, default=None, help="where sessions live (default as for new ones)")
    if command == "status":
        parser.description = "List this user's mpsrun sessions on this node."
        parser.add_argument("--json", action="store_true", help="print JSON")
    else:
        parser.description = "Stop and remove this user's stale sessions (owner gone); never another user's."
        parser.add_argument(
            "--force",
            action="append",
            default=[],
            metavar="SESSION",
            help="also stop and remove this live session (repeatable)",
        )
        parser.add_argument("--dry-run", action="store_true", help="say what would be done")
    args = parser.parse_args(argv)
    if command == "cleanup":
        done = cleanup(args.tmpdir, args.force, args.dry_run)
        for session, what in done:
            print(f"{session}: {what}")
        if not done:
            print("mpsrun cleanup: nothing to clean up")
        return 0
    records = list_sessions(args.tmpdir)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "session": r.session_id,
                        "directory": str(r.root),
                        "owner_pid": r.info.get("pid"),
                        "owner_alive": r.owner_alive,
                        "age_s": round(r.age, 1),
                        "stale": r.stale,
                        "daemons": [
                            {"gpu": d.gpu, "pid": d.pid, "alive": d.alive, "servers": _servers(d)} for d in r.daemons
                        ],
                    }
                    for r in records
                ],
                indent=1,
            )
        )
        return 0
    if not records:
        print("mpsrun status: no sessions")
        return 0
    print(f"{'SESSION':<11} {'OWNER':<14} {'AGE':>7}  {'DAEMONS (pid state servers)':<40} DIRECTORY")
    for r in records:
        owner = f"{r.info.get('pid', '?')} {'alive' if r.owner_alive else 'GONE'}"
        daemons = "; ".join(f"{d.pid} {'up' if d.alive else 'gone'} {_servers(d)}" for d in r.daemons) or "-"
        print(f"{r.session_id:<11} {owner:<14} {_age(r.age):>7}  {daemons:<40} {r.root}")
    stale = sum(r.stale for r in records)
    if stale:
        print(f"{stale} stale session(s): run `mpsrun cleanup`")
    return 0
