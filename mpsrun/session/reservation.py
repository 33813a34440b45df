"""A node session's reservation: the directory a node's starting rank makes for the keeper it starts.

The rank makes it, under the user's lock, with a file that holds a fresh token (:func:`reserve_session_name`), once
it has started the keeper for it: a keeper whose request never comes drops it. The keeper claims it
(:func:`claim_reserved`) only while that token is there, under the same lock: its record goes in and the mark goes.
The rank drops it (:func:`drop_reservation`) when its keeper failed, or ended before it was ready, again only with its
own token. So a keeper that outlived what its rank saw of it (the rank saw the keeper's first process killed, after it
had forked) never takes a directory of that name that another rank reserved since.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mpsrun.errors import MPSError
from mpsrun.runtime.files import read_file, remove_tree
from mpsrun.session.paths import DIRECTORY_FLAGS, SessionDirs, open_user_root, user_root, user_root_lock
from mpsrun.session.record import SessionRecord

__all__ = ["RESERVATION", "claim_reserved", "drop_reservation", "holds_reservation", "reserve_session_name"]

RESERVATION = "reserved"  # the file in a node session's directory until its keeper claims it


def reserve_session_name(base: Path, name: str, token: str) -> None:
    """Make the directory of the node session ``name`` for the keeper that will claim it, with a file that holds
    ``token`` (a fresh one), which tells this reservation from a later one of that name. FileExistsError if
    there is a directory of that name."""
    root_fd = open_user_root(base)
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
        session_fd = os.open(name, DIRECTORY_FLAGS, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        marker = os.open(RESERVATION, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=session_fd)
        with open(marker, "w") as stream:
            stream.write(token)
    except BaseException:  # (no room for the mark): the directory goes with it
        with contextlib.suppress(OSError):
            os.unlink(RESERVATION, dir_fd=session_fd)
        drop_reservation(base, name, token)
        raise
    finally:
        os.close(session_fd)


def holds_reservation(base: Path, name: str, token: str) -> bool:
    """Whether the directory of the node session ``name`` is still the one :func:`reserve_session_name` made with
    ``token``, unclaimed (ask under the user's lock: its maker may drop it, and another rank reserve it again)."""
    with contextlib.suppress(OSError):  # (read safely: a rank may have planted a FIFO there)
        return read_file(user_root(base) / name / RESERVATION, len(token)) == token.encode()
    return False


def drop_reservation(base: Path, name: str, token: str) -> None:
    """Remove the directory :func:`reserve_session_name` made with ``token``, if no keeper claimed it (the keeper
    died first, or refused), or one left empty there (its maker killed before it wrote its mark: under the user's
    lock, held here, an empty directory of a node session's name is no one's)."""
    if holds_reservation(base, name, token):
        with contextlib.suppress(OSError):
            remove_tree(user_root(base) / name)
    else:
        with contextlib.suppress(OSError):  # (not empty, or no directory: not touched)
            os.rmdir(user_root(base) / name)


def claim_reserved(base: Path, name: str, token: str, record: SessionRecord) -> SessionDirs:
    """The node session's directory, reserved for us with ``token``, claimed: our record in it, then its mark gone
    (the directory is never without an owner's mark). MPSError where it is no longer ours, and nothing there is
    touched (it may be another keeper's by now)."""
    with user_root_lock(base):
        if not holds_reservation(base, name, token):
            raise MPSError(f"this node's session directory {name} was given up before its keeper could claim it")
        dirs = SessionDirs.create(base, [], name=name, reserved=True)
        try:
            record.write(dirs.record_file)
        except BaseException:
            dirs.remove()
            raise
        with contextlib.suppress(FileNotFoundError):
            (dirs.root / RESERVATION).unlink()
    return dirs
