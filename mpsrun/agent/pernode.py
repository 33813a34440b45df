"""Per-node mode: ``srun -n 8 mpsrun --per-node python sim.py`` (or under ``mpiexec -n 8``).

Every process the batch system or MPI launcher starts is one rank, run by a rank
supervisor. The local ranks of one job step on one node share that node's MPS session,
owned by the node's agent, its keeper (:mod:`mpsrun.agent.keeper`): the first local rank starts
it, under this user's lock on the session root, and every rank joins it through its socket.

The session is named after the job step (``SLURM_JOB_ID.SLURM_STEP_ID``, else the MPI job,
else the launcher process) and the node (``MPSRUN_NODE_ID`` overrides the host name; tests
use it, with separate ``MPSRUN_TMPDIR`` directories, to simulate several nodes on one machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import stat
import subprocess
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

from mpsrun.config.options import JobConfig
from mpsrun.errors import ConfigError, InterruptionError, JoinError, LockHeldError, MPSError
from mpsrun.exitcodes import ExitCode, describe_returncode
from mpsrun.rank.identity import RankIdentity, identity_from_env, job_key
from mpsrun.rank.join import greet, report_failure, take_output
from mpsrun.rank.supervisor import run_rank
from mpsrun.runtime.constants import (
    CONTROL_VARIABLE,
    KEEPER_START_TIMEOUT,
    LOCK_TIMEOUT,
    NODE_ID_VARIABLE,
    TOKEN_VARIABLE,
)
from mpsrun.runtime.deadline import Deadline, poll_until
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import ProcessRef, own_module
from mpsrun.runtime.protocol import Admitted, Hello, Link, Refusal, Welcome, connect, decode
from mpsrun.session.paths import (
    RECORD_FILE,
    base_directory,
    make_user_root,
    user_root,
    user_root_lock,
    validate_base,
)
from mpsrun.session.reservation import RESERVATION, drop_reservation, reserve_session_name

__all__ = ["KeeperRequest", "node_session_name", "run_per_node"]

JOIN_ATTEMPTS = 3  # a keeper may close just as a late rank arrives; the rank then starts a new one


class KeeperRequest(NamedTuple):
    """What the rank that starts a keeper tells it: the node session's name and base, the job's configuration (as
    the rank read it), the token of the directory it reserved for the keeper (see :func:`_reserve`), how many ranks
    the launcher put on the node and in the job, the CUDA_VISIBLE_DEVICES every local rank must share, under
    ``--hosts`` the job's command and token and the starting rank's stdout and stderr (their descriptors in the
    keeper: see :func:`_start_keeper`), the starting rank's number, its parent (pid, start time): the node's
    launcher, and when it started (``time.monotonic()``: --timeout counts from there)."""

    name: str
    base: str
    config: dict[str, Any]
    reservation: str
    local_size: int | None = None
    world_size: int | None = None
    devices: str | None = None
    upstream: str | None = None
    token: str = ""
    starter: int | None = None
    launcher: tuple[int, int] | None = None
    output: tuple[int, int] | None = None
    started: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KeeperRequest:
        output = data.get("output")
        return cls(**{**data, "output": None if output is None else (output[0], output[1])})


def node_session_name(env: Mapping[str, str]) -> str:
    node = env.get(NODE_ID_VARIABLE) or socket.gethostname()
    return f"j{zlib.crc32(f'{node}:{job_key(env)}'.encode()):08x}"  # 32 bits, as a sha256 prefix was, without OpenSSL


class ReservedKeeper(NamedTuple):
    """A node session's directory reserved with ``token`` for the keeper started for it first (``process``: its first
    process, which waits for its request on stdin), and the descriptors of this rank's stdout and stderr it was given
    (under ``--hosts``: see :func:`_start_keeper`)."""

    token: str
    process: subprocess.Popen[bytes]
    output: tuple[int, int] | None


def _spawn_keeper(base: Path, name: str, token: str) -> ReservedKeeper:
    """Start the keeper for the directory about to be reserved with ``token``, before it is: a keeper whose request
    never comes (this rank killed before it sent it) drops that reservation itself, as nothing else would."""
    output = (os.dup(1), os.dup(2)) if os.environ.get(CONTROL_VARIABLE) else None
    try:
        process = subprocess.Popen([*own_module("mpsrun.agent.keeper"), str(base), name, token],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   start_new_session=True, pass_fds=output or ())
    finally:
        for fd in output or ():
            os.close(fd)
    return ReservedKeeper(token, process, output)


def _start_keeper(base: Path, name: str, reserved: ReservedKeeper, config: JobConfig,
                  identity: RankIdentity, started: float | None = None) -> IO[bytes]:
    """Send the keeper started for the reserved directory its request, and wait until it answers or says why it
    cannot.

    Returns the keeper's answering pipe, still open: the keeper knows by its closing that this rank will not come,
    so it is closed only once this rank has joined (or when this process ends).

    Under ``--hosts`` the keeper gets our stdout and stderr (where the MPI launcher that mpsrun started forwards this
    rank's output), and the node's ranks write there, each line under one lock: the launcher forwards each
    process's output in pieces, cutting lines of ranks that write at once. Under a bare ``--per-node`` the launcher is
    the user's, and so is each rank's output (its tags and its files per rank)."""
    request = KeeperRequest(name=name, base=str(base), config=config.to_json(), reservation=reserved.token,
                            local_size=identity.local_world_size, world_size=identity.world_size,
                            devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                            upstream=os.environ.get(CONTROL_VARIABLE), token=os.environ.get(TOKEN_VARIABLE, ""),
                            starter=identity.rank, launcher=ProcessRef.of(os.getppid()), output=reserved.output,
                            started=started)
    keeper = reserved.process
    assert keeper.stdin is not None and keeper.stdout is not None
    with contextlib.suppress(BrokenPipeError), keeper.stdin:  # a keeper killed at once: its status, below, says so
        keeper.stdin.write(json.dumps(request._asdict()).encode())
    if keeper.wait() != 0:  # it forks into the background at once (exit 0) and answers on the pipe
        keeper.stdout.close()
        raise JoinError(f"this node's keeper {describe_returncode(keeper.returncode)} before its session was ready",
                        speaks=True)
    # The keeper bounds its own start-up by --timeout and then says so; a little later we stop waiting.
    wait = KEEPER_START_TIMEOUT if config.timeout is None else min(KEEPER_START_TIMEOUT, config.timeout + 10)
    ready, _, _ = select.select([keeper.stdout], [], [], wait)
    line = keeper.stdout.readline() if ready else None
    answer = decode(line) if line else None
    if isinstance(answer, Admitted):
        return keeper.stdout
    keeper.stdout.close()
    if line is None and config.timeout is not None:  # the rank that started the keeper says why, as it knows
        raise JoinError(f"timed out after {config.timeout:g} s while this node's session started", speaks=True,
                        exit_code=ExitCode.TIMEOUT)
    if not isinstance(answer, Refusal):
        raise JoinError(f"this node's session did not start within {wait:g} s" if line is None
                        else "this node's keeper ended before its session was ready", speaks=True)
    raise JoinError(answer.message, speaks=_starter_says(answer.exit_code, identity.local_rank),
                    exit_code=answer.exit_code)


def _transient(exit_code: int) -> bool:
    """A keeper's start-up failure that another keeper would not meet again (it was signalled, or timed out)."""
    return exit_code == ExitCode.TIMEOUT or exit_code > 128


def _starter_says(exit_code: int, local_rank: int) -> bool:
    """Whether the rank that started a keeper says why it failed: a failure any keeper of the node would meet (a bad
    option, MPS unavailable) is said by the node's local rank 0, whether it started that keeper or waited for it, so
    ranks that come later and meet it again add nothing; one that only this keeper met, by its starting rank."""
    return _transient(exit_code) or local_rank == 0


def _reserve(base: Path, name: str) -> ReservedKeeper | None:
    """Under the user's lock: reserve the node session's directory for a keeper of ours (started first); None while
    another keeper starts or closes in it. A dead keeper's directory is reaped first (or set aside, its logs kept),
    and what no keeper left there (a file, a FIFO, a link, a directory of neither record nor reservation) goes at
    once."""
    directory = user_root(base) / name
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            directory.unlink()  # (a link only: never followed)
        else:
            from mpsrun.session import registry  # rarely needed: not imported by every rank

            unmarked = _unmarked(directory)
            if not unmarked and not registry.read_state(directory).stale:
                return None
            registry.reap(directory, force=unmarked, locked=True)
            if os.path.lexists(directory):
                directory.rename(directory.with_name(f"{name}-{os.urandom(3).hex()}"))  # (secrets: OpenSSL's import)
    reserved = _spawn_keeper(base, name, os.urandom(8).hex())
    try:
        reserve_session_name(base, name, reserved.token)
    except BaseException as exc:
        _dismiss(reserved.process)
        if isinstance(exc, FileExistsError):  # made there just now, not under the lock (so no keeper's): looked at
            return None  # again
        if isinstance(exc, OSError):  # (no room, no inode left): every rank of the node meets it
            raise MPSError(f"cannot make this node's session directory {directory}: {exc.strerror}",
                           path=str(directory)) from None
        raise
    return reserved


def _dismiss(keeper: subprocess.Popen[bytes]) -> None:
    """A keeper started for a reservation that was not made, ended: it has nothing yet (it waits for its request,
    and its end without one would wait for the user's lock, which we hold)."""
    for pipe in (keeper.stdin, keeper.stdout):
        if pipe is not None:
            pipe.close()
    keeper.kill()
    keeper.wait()


def _unmarked(directory: Path) -> bool:
    """Under the user's lock: whether a node session's directory is no keeper's. A keeper's directory always holds
    its record or its starting rank's reservation, regular files (each made, and the one replaced by the other,
    under that lock); one with neither was planted, or left by what died."""
    def regular(mark: str) -> bool:
        with contextlib.suppress(OSError):
            return stat.S_ISREG(os.lstat(directory / mark).st_mode)
        return False

    return not (regular(RECORD_FILE) or regular(RESERVATION))


def _connect_or_reserve(base: Path, name: str, address: str, config: JobConfig,
                        identity: RankIdentity, started: float | None = None) -> Link | ReservedKeeper:
    """The node keeper's link; or, with no keeper, the directory reserved for ours, which is started. The user's
    lock is held only to look and to reserve: another keeper's start-up or closing is waited for without it, until
    --timeout at most."""

    def attempt() -> Link | ReservedKeeper | None:
        with user_root_lock(base, deadline.cap(LOCK_TIMEOUT)):  # (a process of the user may hold it for good)
            with contextlib.suppress(OSError):
                return connect(address, keep_descriptors=True)
            return _reserve(base, name)

    timed = config.timeout is not None and config.timeout < KEEPER_START_TIMEOUT
    deadline = Deadline(config.timeout if timed else KEEPER_START_TIMEOUT, since=started)
    said = identity.local_rank == 0  # (every rank of the node waited for the same directory)
    try:
        found = cast("Link | ReservedKeeper | None", poll_until(attempt, deadline))  # mypy solves no unions
    except LockHeldError:
        if not timed:
            raise
        held = f"another process of yours holds the lock on {user_root(base)}"
        raise JoinError(f"timed out after {config.timeout:g} s while this node's session started: {held}",
                        speaks=said, exit_code=ExitCode.TIMEOUT) from None
    if found is not None:
        return found
    held = f"{user_root(base) / name} looks in use (a live keeper's record, or a reservation of the last minute)"
    if timed:
        raise JoinError(f"timed out after {config.timeout:g} s while this node's session started: {held}",
                        speaks=said, exit_code=ExitCode.TIMEOUT)
    raise JoinError(f"this node's session was neither ready nor gone within {KEEPER_START_TIMEOUT:g} s: {held}",
                    speaks=said)


def _join_node(base: Path, name: str, config: JobConfig, identity: RankIdentity,
               started: float) -> tuple[Link, IO[bytes] | None]:
    """Connect to the node's keeper, starting it if there is none (then also the pipe that tells it we are here);
    ``started``: when this rank started (``time.monotonic()``), whence --timeout counts."""
    address = f"unix:{user_root(base) / name / 'control'}"
    found = _connect_or_reserve(base, name, address, config, identity, started)
    if isinstance(found, Link):
        return found, None
    try:
        pipe = _start_keeper(base, name, found, config, identity, started)
    except BaseException:
        with user_root_lock(base):
            drop_reservation(base, name, found.token)
        raise
    try:
        return connect(address, keep_descriptors=True), pipe
    except BaseException:
        pipe.close()
        raise


def run_per_node(config: JobConfig, environ: Mapping[str, str] | None = None) -> int:
    """Run ``config.command`` as this process's rank, in the node's shared session; the rank's exit code."""
    started = time.monotonic()
    env = os.environ if environ is None else environ
    identity: RankIdentity | None = identity_from_env(env)
    if identity is None:
        raise MPSError("--per-node: no local-rank variable from the launcher (OMPI_COMM_WORLD_LOCAL_RANK, "
                       "MPI_LOCALRANKID, SLURM_LOCALID, ...): start mpsrun --per-node with srun or mpiexec")
    if identity.world_size is None and config.nranks is not None:
        identity = RankIdentity(identity.rank, identity.local_rank, config.nranks, identity.local_world_size)
    if (impossible := identity.impossible()) is not None:  # said by every such rank: its own variables
        raise ConfigError(f"--per-node: the launcher's variables do not fit together: {impossible}",
                          setting="launcher", value=identity._asdict())
    if (config.mpiexec or config.mpiexec_args) and CONTROL_VARIABLE not in env and identity.local_rank == 0:
        say("mpsrun: warning: --mpiexec and --mpiexec-arg have no effect with --per-node (the launcher that started "
            "this rank is the job's)")
    base = base_directory(env)
    try:
        if config.nranks is not None and config.nranks != identity.world_size:
            raise ConfigError(f"--per-node: -np {config.nranks}, but the launcher started {identity.world_size} "
                              "ranks", setting="-np", value=config.nranks)
        validate_base(base)
        make_user_root(base)  # refused here, before any keeper, if it is not safe
    except InterruptionError:  # the launcher signals every rank: said once per node, by mpsrun.cli.main
        raise
    except MPSError as exc:
        report_failure(exc, identity.local_rank)
        return exc.exit_code
    name = node_session_name(env)
    rank, joining = identity.rank, identity  # (mypy keeps no narrowing into the closure)

    def join(hello: Hello) -> tuple[Link, Welcome | Refusal | None]:
        for _ in range(JOIN_ATTEMPTS):
            link, pipe = _join_node(base, name, config, joining, started)
            with pipe or contextlib.nullcontext():  # we started the keeper: held until it has answered us
                answer = greet(link, hello._replace(settings=json.dumps(config.settings(), sort_keys=True)))
            take_output(link, answer)
            if isinstance(answer, Welcome) or (answer is not None and not answer.retry and not answer.failed):
                return link, answer
            link.close()
            if answer is None:  # no answer, no refusal: the keeper died (and a new one would only hide why)
                raise JoinError(f"this node's keeper ended before rank {rank} could join", speaks=False)  # as
                # the rank that started it, which saw it die, says
            if answer.failed:  # the keeper could not start: said once (see _starter_says)
                said = joining.local_rank == 0 and not (_transient(answer.exit_code) and answer.heard)
                raise JoinError(answer.message, exit_code=answer.exit_code, speaks=said)
        raise JoinError(f"--per-node: this node's session kept closing before rank {rank} could join", speaks=True)

    return run_rank(config.command, identity, join, token=name)
