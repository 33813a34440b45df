"""Per-node start-up under load and faults (issue 25, item 5): jobs of one user never queue behind each other's
keepers, and a keeper that dies while it starts fails its node at once, in one line, leaving nothing.

The first rank of a node reserves the node session's directory under the user's lock and starts the keeper
without it; the other ranks wait for that keeper, not for the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import MPSRUN, descendants, fake, job_argv, mpiexec, settle, wait_for

from mpsrun.agent.ranks import Doorway
from mpsrun.errors import MPSError
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import LATE_WAIT
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.protocol import Hello, Listener, Refusal, Welcome, connect
from mpsrun.session import registry
from mpsrun.session.claim import SessionClaim
from mpsrun.session.paths import SessionDirs, user_root
from mpsrun.session.record import SessionRecord
from mpsrun.session.reservation import RESERVATION, drop_reservation, holds_reservation, reserve_session_name


def _without_faults() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("FAKE_MPS_")}


def _keeper(fake_gpu) -> psutil.Process | None:
    """The node keeper of this fake machine once its daemon was started (its log exists): the owner its session's
    record names (the process that forked into the keeper is gone by then); else None."""
    for record in fake_gpu.tmpdir.glob("mpsrun-*/*/session.json"):
        if list(record.parent.rglob("control.log")):
            with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
                return psutil.Process(json.loads(record.read_text())["owner"]["pid"])
    return None


def _waiting_ranks(fake_gpu) -> int:
    """How many connections wait on the node keeper's control socket (the ranks that did not start it), from
    /proc/net/unix, where each connection's server side carries the socket's path."""
    paths = {str(path) for path in fake_gpu.tmpdir.glob("mpsrun-*/*/control")}
    with open("/proc/net/unix") as table:
        found = [line.split()[-1] for line in table if len(line.split()) == 8]
    return max(0, sum(path in paths for path in found) - len(paths))  # less each listener's own line


def _mpsrun_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mpsrun")]


@pytest.mark.mpiexec
def test_a_slow_keeper_start_does_not_hold_up_another_job(fake_gpu, short_tmp):
    """A per-node job whose daemon never answers is still starting while another job of the same user runs to
    its end on the node (it waited for the first job's whole start-up under the user's lock: 14-21 of 30
    concurrent jobs failed after 60 s)."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    slow = subprocess.Popen(job_argv("per-node", [], ["true"], ranks=2), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _keeper(fake_gpu), what="the slow job's keeper did not start its daemon", proc=slow)
        quick = subprocess.run(job_argv("per-node", [], fake("--report-dir", str(short_tmp)), ranks=2),
                               capture_output=True, text=True, timeout=120, env=_without_faults())
        assert quick.returncode == 0, quick.stderr
        assert slow.poll() is None, "the quick job ran only after the slow one's start-up ended"
        assert all(json.loads(p.read_text())["mps"] for p in short_tmp.glob("*.json"))
    finally:
        for proc in descendants(slow, "--per-node"):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
        slow.communicate(timeout=60)
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_concurrent_per_node_jobs_all_run_and_leave_nothing(fake_gpu):
    """Eight 2-rank per-node jobs of one user at once on one node: each exits 0, and no keeper, daemon or
    directory outlives them."""
    jobs = [subprocess.Popen(job_argv("per-node", ["--mps", "on"], fake("--hold", "0.5"), ranks=2),
                             stderr=subprocess.PIPE, text=True) for _ in range(8)]
    results = [(job.wait(timeout=240), job.communicate()[1]) for job in jobs]
    assert all(code == 0 for code, _ in results), results
    settle(fake_gpu)


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGKILL, 3, "keeper ended before"),
                                                   (signal.SIGTERM, 143, "keeper was interrupted by SIGTERM")])
def test_a_keeper_killed_in_start_up_fails_its_node_at_once(fake_gpu, path, sig, code, said):
    """SIGKILL or SIGTERM to the node keeper while its daemon does not answer: exit 3 (143 for SIGTERM) and one line
    saying what happened to the keeper, at once, whichever local rank started it (another rank started a
    replacement keeper that waited out the daemon's 30 s, and the dead keeper's reaper removed the replacement's
    directory: 'daemon died', 'did not start within 120 s'; a starter that was not local rank 0 said nothing)."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    job = subprocess.Popen(job_argv(path, ["--mps", "on"], ["true"], ranks=2), stderr=subprocess.PIPE, text=True)
    keeper = wait_for(lambda: _keeper(fake_gpu), what="the keeper did not start its daemon", proc=job)
    wait_for(lambda: _waiting_ranks(fake_gpu) >= 1, what="the other rank did not come to wait for the keeper",
             proc=job)  # a rank that comes only after the keeper died starts a keeper of its own, rightly
    keeper.send_signal(sig)
    _, err = job.communicate(timeout=120)
    lines = _mpsrun_lines(err)
    assert job.returncode == code and len(lines) == 1 and said in lines[0], err
    settle(fake_gpu, timeout=20.0)  # well before the 30 s a replacement keeper waited for its daemon


def test_a_dead_owners_reaper_leaves_the_next_owner_of_its_name_alone(short_tmp):
    """The reaper of a dead node keeper reaps the directory of that name only while it is still that keeper's:
    not once another rank reserved it again, nor once a new keeper's record names another owner."""
    name = "jfeedf00d"
    root = user_root(short_tmp) / name
    reserve_session_name(short_tmp, name, "t0")
    assert registry.reap(root, force=True, owner=os.getpid()) is None and (root / RESERVATION).exists()
    SessionRecord.new("node").write(root / "session.json")  # a new owner: this process
    assert registry.reap(root, force=True, owner=os.getppid()) is None and root.is_dir()
    assert registry.reap(root, force=True, owner=os.getpid()) is not None and not root.exists()


def test_a_reservation_is_claimed_by_its_keeper_and_dropped_only_by_its_maker(short_tmp):
    """A reservation is dropped only with its own token; a reserved directory is taken as it is, its mark kept
    until its keeper's claim (test_a_keeper_whose_reservation_was_dropped_claims_nothing_of_the_names_next_owner)."""
    name = "jc0ffee00"
    token = "t1"  # noqa: S105 - a reservation's, no password
    reserve_session_name(short_tmp, name, token)
    drop_reservation(short_tmp, name, "another token")
    assert (user_root(short_tmp) / name / RESERVATION).exists()
    drop_reservation(short_tmp, name, token)
    assert not (user_root(short_tmp) / name).exists()
    reserve_session_name(short_tmp, name, "t2")
    dirs = SessionDirs.create(short_tmp, [0], name=name, reserved=True)
    assert (dirs.root / RESERVATION).exists() and (dirs.root / "gpu0" / "pipe").is_dir()
    dirs.remove()
    assert not dirs.root.exists()


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["local", "mpiexec", "hosts"])
def test_a_killed_rank_supervisor_is_named_on_every_launcher(fake_gpu, short_tmp, path):
    """SIGKILL to one rank's mpsrun supervisor: the summary names that rank as lost with its supervisor on every
    launcher (under --hosts it said only 'mpiexec exited with code 9 while rank(s) 0-1 ran' when mpiexec ended
    before the node keeper's report came). The code: 137 locally, and the launcher's own under mpiexec (MPICH's
    Hydra: the bare 9, which it also gives for MPI_Abort(9); Open MPI: 137)."""
    job = subprocess.Popen(job_argv(path, [], fake("--hold", "60", "--report-dir", str(short_tmp)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(list(short_tmp.glob("*.json"))) >= 2, what="the ranks did not start", proc=job)
    ranks = descendants(job, "mpsrun.rank.pyrun")  # (a helper of mpsrun's may end as we look)
    victim = max(ranks, key=lambda proc: proc.pid)
    rank = next(int(report.stem) for report in short_tmp.glob("*.json")
                if json.loads(report.read_text())["pid"] == victim.pid)
    victim.parent().kill()
    _, err = job.communicate(timeout=120)
    named = f"rank {rank} (pid {victim.pid}) ended without reporting first (its supervisor is gone)"
    if path == "local":
        assert named in err, err
    else:  # MPICH's Hydra SIGKILLs the other rank's supervisor at once: which loss is heard of first is a race
        assert named in err or "ended without reporting first (its supervisor is gone)" in err, err
    if path == "local":
        assert job.returncode == 137 and f"rank {rank}'s supervisor was killed by signal 9 (SIGKILL)" in err, err
    else:
        assert job.returncode in (9, 137) and f"exited with code {job.returncode}" in err, err
    settle(fake_gpu)


# The rank that starts the node's keeper: it reserves the node's session, starts the keeper and says "ready"; when
# its stdin ends it either exits without joining (as an interrupt or SIGKILL right after its keeper was ready can
# leave it) or, given "join", joins as `mpsrun --per-node true`, still holding the keeper's pipe.
_STARTER = """
import os, sys
from mpsrun.cli import _config
from mpsrun.agent import pernode
from mpsrun.rank.identity import identity_from_env
from mpsrun.session.paths import base_directory, make_user_root, user_root

base, name = base_directory(os.environ), pernode.node_session_name(os.environ)
make_user_root(base)
config, identity = _config(["--per-node", "true"]), identity_from_env(os.environ)
reserved = pernode._connect_or_reserve(base, name, f"unix:{user_root(base) / name / 'control'}", config, identity)
assert isinstance(reserved, pernode.ReservedKeeper)
pipe = pernode._start_keeper(base, name, reserved, config, identity)
print("ready", flush=True)
sys.stdin.read()
if sys.argv[1:] == ["join"]:
    os.set_inheritable(pipe.fileno(), True)
    os.execv(sys.executable, [sys.executable, "-m", "mpsrun", "--per-node", "true"])
"""


_KILLED_AFTER_RESERVING = """
import os, signal
from mpsrun.cli import _config
from mpsrun.agent import pernode
from mpsrun.rank.identity import identity_from_env
from mpsrun.session.paths import base_directory, make_user_root, user_root

base, name = base_directory(os.environ), pernode.node_session_name(os.environ)
make_user_root(base)
config, identity = _config(["--per-node", "true"]), identity_from_env(os.environ)
reserved = pernode._connect_or_reserve(base, name, f"unix:{user_root(base) / name / 'control'}", config, identity)
assert (user_root(base) / name / "reserved").exists()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_between_its_reservation_and_its_keepers_request_leaves_nothing(fake_gpu):
    """A rank SIGKILLed once it has reserved its node's session directory, before it sent its keeper the request:
    the keeper, started before the reservation was made, never gets its request and drops the reservation. The
    directory was left for good (a rank that reserved as its keeper gave up was killed by the job's end, in 1 of
    about 50 runs under load of test_a_signal_in_per_node_start_up_leaves_nothing_soon)."""
    killed = subprocess.run([sys.executable, "-c", _KILLED_AFTER_RESERVING], capture_output=True, text=True,
                            timeout=60, env=_node_rank_env(0))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert settle(fake_gpu, timeout=20.0), "the reservation was left"


_GONE_AFTER_THE_REQUEST = """
import json, os
from mpsrun.runtime.processes import ProcessRef
from mpsrun.cli import _config
from mpsrun.agent import pernode
from mpsrun.rank.identity import identity_from_env
from mpsrun.session.paths import base_directory, make_user_root, user_root

base, name = base_directory(os.environ), pernode.node_session_name(os.environ)
make_user_root(base)
config, identity = _config(["--per-node", "true"]), identity_from_env(os.environ)
reserved = pernode._connect_or_reserve(base, name, f"unix:{user_root(base) / name / 'control'}", config, identity)
request = pernode.KeeperRequest(name=name, base=str(base), config=config.to_json(), reservation=reserved.token,
                                local_size=2, world_size=2, starter=0, launcher=ProcessRef.of(os.getppid()))
reserved.process.stdout.close()  # gone before the keeper could answer (the rest goes as this process ends)
reserved.process.stdin.write(json.dumps(request._asdict()).encode())
reserved.process.stdin.close()
assert reserved.process.wait() == 0
"""


def test_a_rank_gone_as_soon_as_it_sent_its_keepers_request_leaves_nothing(fake_gpu):
    """The rank that started a node keeper is gone right after it sent the request: the keeper, which stops as soon
    as it finds no one reading its answer, stops cleanly, its reservation or claim removed (the SIGTERM it sends
    itself came before its handler was in place: it died with the reservation left, in about 1 of 100 runs under
    load of a job whose ranks were killed in its start-up). Three times, as the moment varies."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")  # (the keeper is abandoned before its session is ready)
    for _ in range(3):
        gone = subprocess.run([sys.executable, "-c", _GONE_AFTER_THE_REQUEST], capture_output=True, text=True,
                              timeout=60, env=_node_rank_env(0))
        assert gone.returncode == 0, gone.stderr
        assert settle(fake_gpu, timeout=20.0), "the node's session was left"


def test_a_keeper_whose_reservation_was_dropped_claims_nothing_of_the_names_next_owner(short_tmp):
    """The rank that reserved a node session's directory saw its keeper die (SIGKILL before its fork returned) and
    dropped the reservation; another rank reserved the name again. The first keeper, which lived on past its fork,
    claims nothing there: it fails with one line, and the new reservation stays whole for its own keeper (it took
    that directory, and the second keeper failed with 'node keeper failed: OSError(98, 'Address already in use')',
    binding the control socket the first had bound there)."""
    name = "jc0ffee01"
    first, second = "t1", "t2"
    reserve_session_name(short_tmp, name, first)
    drop_reservation(short_tmp, name, first)
    reserve_session_name(short_tmp, name, second)
    with pytest.raises(MPSError, match=f"directory {name} was given up before its keeper could claim it"):
        SessionClaim.make(short_tmp, "node", name, reservation=first)
    assert holds_reservation(short_tmp, name, second)
    claim = SessionClaim.make(short_tmp, "node", name, reservation=second)
    assert claim.dirs is not None and not holds_reservation(short_tmp, name, second) and claim.dirs.record_file.exists()
    assert not claim.release() and not (user_root(short_tmp) / name).exists()


def _node_rank_env(rank: int, local_size: bool = True) -> dict[str, str]:
    """The variables MPICH's Hydra gives rank ``rank`` of a 2-rank job on one node (without the node's rank count:
    as a launcher that does not say it)."""
    env = {**os.environ, "MPSRUN_JOB_ID": "starter", "PMI_RANK": str(rank), "PMI_SIZE": "2",
           "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "2"}
    return env if local_size else {name: value for name, value in env.items() if name != "MPI_LOCALNRANKS"}


@pytest.mark.parametrize("gone", ["before", "after"])
def test_a_starter_gone_before_it_joined_does_not_keep_the_node(fake_gpu, gone):
    """The rank that started the node keeper ends right after the keeper is ready, without joining, ``before`` or
    ``after`` the node's other rank runs to its end: the keeper, its daemon and the session are gone at once (the
    keeper waited its full 30 s for the starting rank to come)."""
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=_node_rank_env(0))
    try:
        assert starter.stdout is not None and starter.stdout.readline() == "ready\n"
        if gone == "before":
            starter.communicate(timeout=60)
        other = subprocess.run([*MPSRUN, "--per-node", "true"], capture_output=True, text=True, timeout=120,
                               env=_node_rank_env(1))
        assert other.returncode == 0, other.stderr
    finally:
        starter.communicate(timeout=60)
    assert settle(fake_gpu, timeout=LATE_WAIT / 3), "the node's session waited for its starter after the job"


def test_the_keeper_keeps_the_node_for_its_starter(fake_gpu):
    """A launcher that does not say how many ranks share the node: the rank that started the keeper joins only
    after another rank ran to its end, and the session is still there for it (the keeper closed after the first
    rank, and a starter that connected as it closed failed with exit 3, silently when not local rank 0)."""
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, "join"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_node_rank_env(0, local_size=False))
    try:
        assert starter.stdout is not None and starter.stdout.readline() == "ready\n"
        other = subprocess.run([*MPSRUN, "--per-node", "true"], capture_output=True, text=True, timeout=120,
                               env=_node_rank_env(1, local_size=False))
        assert other.returncode == 0, other.stderr
        [session] = fake_gpu.session_dirs()
    finally:
        _, err = starter.communicate(timeout=120)
    assert starter.returncode == 0, err
    assert not session.exists() and settle(fake_gpu, timeout=LATE_WAIT / 3)


def test_a_rank_connected_but_unheard_when_its_keeper_closes_is_asked_to_come_again(short_tmp):
    """A rank whose connection the keeper accepted, but whose hello it had not yet read when it began to close, is
    told to come again (to a new keeper); it met a closed connection and failed with 'this node's keeper ended
    before rank N could join', said by no one when it was not the node's local rank 0."""
    address = f"unix:{short_tmp / 'control'}"
    loop, listener = EventLoop(), Listener(address)
    token = secrets.token_hex(8)
    doorway = Doorway(loop, listener, token, lambda *heard: None, lambda *told: None, lambda *lost: None)
    link = connect(address)
    loop.run_once(10.0)  # accepted
    link.send(Hello("rank", token, rank=1, local_rank=1))
    doorway.close_door()
    listener.close()
    loop.close()
    assert link.expect((Welcome, Refusal), Deadline(10.0)) == Refusal(retry=True)


def _first_keeper(fake_gpu) -> psutil.Process | None:
    """A node keeper process of this fake machine, as soon as one runs (before it has forked, or after)."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "from mpsrun.agent.keeper import main" in " ".join(proc.info["cmdline"] or []) and \
                    proc.environ().get("MPSRUN_TMPDIR") == str(fake_gpu.tmpdir):
                return proc
    return None


def _killed_first_keeper(fake_gpu) -> bool:
    """SIGKILL to a node keeper of this fake machine as soon as one runs: False while none was found alive (the one
    found may end as it is found: the keeper before its fork, under load)."""
    keeper = _first_keeper(fake_gpu)
    if keeper is None:
        return False
    with contextlib.suppress(psutil.NoSuchProcess):
        keeper.kill()
        return True
    return False


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_keeper_killed_as_it_appears_leaves_nothing_after_the_job(fake_gpu, short_tmp, path):
    """SIGKILL to the node keeper the moment it appears: the job fails with one line, and the keeper the other rank
    then started, with its daemons and session, is gone with the job (it waited 30 s for the rank that had
    failed; under --hosts the job took 31-35 s to end). The daemons answer only after 5 s, so that the kill lands
    while the keeper starts, however late a loaded machine lets the test see it (it came after the ranks had joined:
    each then said that its controller died)."""
    fake_gpu.daemon_env(FAKE_MPS_ANSWER_AFTER="5")
    job = subprocess.Popen(job_argv(path, [], fake("--hold", "5"), ranks=2), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _killed_first_keeper(fake_gpu), what="no keeper started", proc=job)
    _, err = job.communicate(timeout=120)
    assert job.returncode != 0 and len(_mpsrun_lines(err)) <= 1, err
    assert settle(fake_gpu, timeout=LATE_WAIT / 3), "a keeper outlived the job"


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_timeout_while_the_node_starts_is_said_once(fake_gpu, path):
    """--timeout 0.5 while the node's daemon does not answer: exit 124 and exactly one line saying so, whichever
    local rank started the keeper (bare --per-node said nothing in 5 of 6 runs under load: the starting rank,
    not local rank 0, kept its word)."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    out = subprocess.run(job_argv(path, ["--timeout", "0.5"], fake("--hold", "0.3"), ranks=2), capture_output=True,
                         text=True, timeout=120)
    lines = _mpsrun_lines(out.stderr)
    assert out.returncode == 124 and lines and "timed out after 0.5 s" in lines[-1], out.stderr
    assert len([line for line in lines if "timed out" in line]) == 1, out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_ranks_with_different_options_are_told_which(fake_gpu):
    """Per-node ranks started with different options (one with --tag-output): exit 2 and one line that names the
    option (it was a dump of both ranks' settings, some 900 characters), and nothing left."""
    script = 'if [ "$PMI_RANK" = 0 ]; then exec "$@" --tag-output true; else exec "$@" true; fi'
    out = subprocess.run([mpiexec(), "-n", "2", "sh", "-c", script, "sh", *MPSRUN, "--per-node"],
                         capture_output=True, text=True, timeout=120)
    lines = _mpsrun_lines(out.stderr)
    assert out.returncode == 2 and len(lines) == 1 and "(--tag-output)" in lines[0] and len(lines[0]) < 250, \
        out.stderr
    settle(fake_gpu)


def test_a_keeper_killed_before_it_reads_its_request_is_named(monkeypatch, short_tmp):
    """A keeper killed before it has read its request (SIGUSR1 at once): the starting rank says the keeper was
    killed by that signal (it failed with 'cannot reach the job's controller: [Errno 32] Broken pipe', writing the
    request to a dead keeper)."""
    from mpsrun.agent import pernode
    from mpsrun.config.options import JobConfig
    from mpsrun.errors import JoinError

    suicide = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR1)"]
    monkeypatch.setattr(pernode, "own_module", lambda module: suicide)
    with pytest.raises(JoinError, match=r"keeper was killed by signal 10 \(SIGUSR1\) before its session was ready"):
        pernode._start_keeper(short_tmp, "j0", pernode._spawn_keeper(short_tmp, "j0", "token"),
                              JobConfig(command=("true",)), RankIdentity(0, 0, 1, 1))
