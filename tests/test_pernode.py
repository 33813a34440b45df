"""Per-node mode on simulated nodes: one daemon per node, waits, teardown only after the last local rank.

Each simulated node has its own node-local directory (MPSRUN_TMPDIR) and name (MPSRUN_NODE_ID);
the ranks are started the way srun starts them (SLURM_* variables), each as its own mpsrun.
"""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import FAKECUDA, descendants, fake, job_argv, reports, run_job, settle, wait_ready

from mpsrun.agent.pernode import run_per_node
from mpsrun.agent.uplink import join_command
from mpsrun.config.commandline import parse_args
from mpsrun.errors import ConfigError, MPSError
from mpsrun.rank.identity import RankIdentity, identity_from_env, job_key, slurm_tasks_on_node


def start_rank(node_dir, node, local, global_rank, per_node, *args, job="77", options=()):
    """Rank ``global_rank`` of a Slurm step with ``per_node`` tasks on each of two nodes (``node``: "A" or "B"), as
    srun starts it (a step's tasks per node are always in SLURM_STEP_TASKS_PER_NODE), with mpsrun ``options``."""
    env = {**os.environ, "MPSRUN_TMPDIR": str(node_dir), "MPSRUN_NODE_ID": node, "SLURM_JOB_ID": job,
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": str(local), "SLURM_PROCID": str(global_rank),
           "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x2)", "SLURM_NODEID": str("AB".index(node))}
    return subprocess.Popen([sys.executable, "-m", "mpsrun", "--per-node", "--mps", "on", *options, sys.executable,
                             str(FAKECUDA), *args], env=env, stderr=subprocess.PIPE, text=True)


def node_dirs(fake_gpu, names):
    dirs = {}
    for name in names:
        path = fake_gpu.tmpdir / name
        path.mkdir(mode=0o700)
        dirs[name] = path
    return dirs


def leftovers(path):
    root = path / f"mpsrun-{os.getuid()}"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_job_key_and_identity_from_launcher_variables():
    """The job key comes from Slurm, else the MPI job, else the launcher process; a rank's place comes from the
    launcher's variables (Slurm's compressed task counts included)."""
    assert job_key({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "2"}) == "slurm-5.2"
    # A requeued job keeps its id and its steps' numbers: its restart count tells its runs apart (a farm's rerun
    # took up the killed run's shared counter, and skipped the tasks that run had taken and not finished).
    assert job_key({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1"}) == "slurm-5.2.r1"
    assert job_key({"PMIX_NAMESPACE": "ns"}) == "PMIX_NAMESPACE-ns"
    assert job_key({"MPSRUN_JOB_ID": "abc"}) == "MPSRUN_JOB_ID-abc"
    assert job_key({}).startswith("ppid-")
    assert identity_from_env({"SLURM_LOCALID": "3", "SLURM_PROCID": "7", "SLURM_NTASKS": "8",
                              "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}) == RankIdentity(7, 3, 8, 4)
    assert identity_from_env({"MPI_LOCALRANKID": "1", "PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}) == \
        RankIdentity(1, 1, 3, 3)
    assert slurm_tasks_on_node({"SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "2"}) == 2
    assert identity_from_env({"PMI_RANK": "0"}) is None


@pytest.mark.parametrize(("variables", "said"), [
    ({"MPI_LOCALRANKID": "9", "MPI_LOCALNRANKS": "1", "PMI_RANK": "0", "PMI_SIZE": "1"}, "local rank 9 of 1"),
    ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "PMI_RANK": "3", "PMI_SIZE": "2"}, "rank 3 of 2"),
    ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4", "PMI_RANK": "0", "PMI_SIZE": "2"}, "4 ranks on this node of 2"),
])
def test_impossible_launcher_variables_are_refused(fake_gpu, variables, said):
    """A rank whose launcher variables cannot be (a local rank beyond the node's count, a rank beyond the job's
    size) is refused with exit 2 and one line naming them (it was accepted, and its keeper waited for ranks that
    could never come)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("SLURM_", "PMI_", "MPI_"))}
    out = subprocess.run([sys.executable, "-m", "mpsrun", "--per-node", "true"], env={**env, **variables},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("mpsrun") == 1 and said in out.stderr, out.stderr
    assert not fake_gpu.session_dirs()


def test_two_nodes_one_daemon_each_and_teardown_after_the_last_rank(fake_gpu, short_tmp):
    """4 ranks on 2 simulated nodes: each node's ranks share one server; a node's daemon outlives its early
    ranks (the slow rank keeps working) and is gone, with its directory, after the last one."""
    dirs = node_dirs(fake_gpu, ["A", "B"])
    ranks = []
    for global_rank in range(4):
        node = "AB"[global_rank // 2]
        hold = "4" if global_rank % 2 else "0.5"  # local rank 1 outlives local rank 0 by seconds
        ranks.append(start_rank(dirs[node], node, global_rank % 2, global_rank, 2,
                                "--report-dir", str(short_tmp), "--hold", hold))
    errors = [proc.communicate(timeout=120)[1] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0, 0, 0], errors
    seen = {int(p.stem): json.loads(p.read_text()) for p in short_tmp.glob("*.json")}
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(report["mps"] for report in seen.values())
    assert seen[0]["server"] == seen[1]["server"] != seen[2]["server"] == seen[3]["server"]
    assert seen[0]["env"]["CUDA_MPS_PIPE_DIRECTORY"] == seen[1]["env"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert leftovers(dirs["A"]) == [] and leftovers(dirs["B"]) == []


@pytest.mark.parametrize("option", ["--tag-output", "--output-filename", "-x", "--report"])
def test_a_rank_started_with_other_options_than_its_node_is_refused(fake_gpu, tmp_path, option):
    """Every rank of a per-node job must be given the same options: a rank with another --output-filename, -x or
    --report, which the node's session applies to all its ranks, is refused with exit 2 naming the option, as one
    with another --tag-output is. Before, those three were not compared: each rank got the options of whichever
    rank had started the node's session (found by a hostile pass)."""
    [node] = node_dirs(fake_gpu, ["A"]).values()
    value = {"--tag-output": [], "--output-filename": [str(tmp_path / "out")], "-x": ["NAME=1"],
             "--report": [str(tmp_path / "report.json")]}[option]
    ranks = [start_rank(node, "A", 0, 0, 2, "--hold", "1"),
             start_rank(node, "A", 1, 1, 2, "--hold", "1", options=[option, *value])]
    errors = [proc.communicate(timeout=120)[1] for proc in ranks]
    assert 2 in [proc.returncode for proc in ranks], errors
    said = "".join(errors)
    assert "started with other mpsrun options" in said and option in said, said
    assert leftovers(node) == []


def test_a_killed_rank_supervisor_stops_the_node_and_leaves_nothing(fake_gpu, short_tmp):
    """A local rank whose mpsrun --per-node is SIGKILLed is noticed by the node keeper (its connection drops):
    the other local rank is stopped (137, the summary names rank 0), and the daemon and directory are gone."""
    [node] = node_dirs(fake_gpu, ["A"]).values()
    first = start_rank(node, "A", 0, 0, 2, "--report-dir", str(short_tmp), "--hold", "30")
    second = start_rank(node, "A", 1, 1, 2, "--report-dir", str(short_tmp), "--hold", "30")
    wait_ready(short_tmp, count=2, timeout=30)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    _, err = second.communicate(timeout=60)
    assert second.returncode == 137, err
    assert "rank 0 (pid" in err and "ended without reporting" in err
    assert leftovers(node) == []


def test_a_rank_started_twice_by_hand_does_not_keep_the_node(fake_gpu, short_tmp):
    """Two processes started by hand as rank 0 of a node the launcher variables give 2 ranks: the second is refused
    in one line, and the node's session ends with the first rank, well before the 30 s a node keeps for a rank still
    to come (it waited for a second rank, though the refused one had taken that place)."""
    [node] = node_dirs(fake_gpu, ["A"]).values()
    first = start_rank(node, "A", 0, 0, 2, "--report-dir", str(short_tmp), "--hold", "3")
    wait_ready(short_tmp, count=1, timeout=60)
    second = start_rank(node, "A", 0, 0, 2, "--hold", "3")
    _, err = second.communicate(timeout=60)
    assert second.returncode == 3 and err.count("mpsrun") == 1 and "rank 0 is already part of this job" in err, err
    _, err = first.communicate(timeout=20)  # LATE_WAIT (30 s) would come first
    assert first.returncode == 0, err
    assert leftovers(node) == []


def test_per_node_without_launcher_variables_is_a_setup_error(fake_gpu, monkeypatch):
    """--per-node outside srun/mpiexec (no local-rank variable) fails with exit 3 and says why."""
    for name in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, "-m", "mpsrun", "--per-node", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "no local-rank variable" in out.stderr
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_held_lock_on_the_session_root_ends_a_node_start_at_its_timeout(fake_gpu, path):
    """A process of the user that holds the lock on the session root (a rank of an earlier job can leave one behind)
    holds a node's start no longer than --timeout: exit 124 at the timeout, naming the lock, with nothing left.
    (The lock was waited for 60 s, then exit 3.)"""
    root = Path(os.environ["MPSRUN_TMPDIR"]) / f"mpsrun-{os.getuid()}"
    root.mkdir(mode=0o700)
    held = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = run_job(path, ["--timeout", "3"], ["true"], ranks=2, timeout=45)
    finally:
        os.close(held)
    assert out.returncode == 124, out.stderr
    assert "timed out after 3 s" in out.stderr, out.stderr
    if path == "per-node":  # (under --hosts the command's own timeout ends the job, as it would any node's start)
        assert f"holds the lock on {root}" in out.stderr, out.stderr
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


@pytest.mark.mpiexec
def test_a_nodes_timeout_counts_from_its_first_ranks_start_not_from_its_keepers(fake_gpu):
    """The lock on the session root held for the first 2.5 s of a --per-node job of 3 s ranks under --timeout 4:
    the job times out (124), 4 s after its start. The node's keeper counted the timeout from its own start, after
    the wait for the lock, so the job ran on past it and ended 0."""
    root = Path(os.environ["MPSRUN_TMPDIR"]) / f"mpsrun-{os.getuid()}"
    root.mkdir(mode=0o700)
    held = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    release = threading.Timer(2.5, os.close, (held,))
    release.start()
    try:
        out = run_job("per-node", ["--timeout", "4"], ["sleep", "3"], ranks=2, timeout=60)
    finally:
        release.join()
    assert out.returncode == 124, out.stderr
    assert "timed out after 4 s" in out.stderr, out.stderr
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_a_lock_on_the_session_root_taken_under_a_running_node_holds_its_end_no_longer_than_the_timeout(
        fake_gpu, short_tmp, path):
    """A process of the user takes the lock on the session root while a node's ranks run, and holds it: the node's
    keeper turns its ranks away without it once the job's --timeout has passed, says so, and the job ends with its
    ranks' 0, leaving nothing. The keeper waited 60 s for the lock and died (62 s, exit 124 and no line; under --hosts
    0 with 'timed out')."""
    root = Path(os.environ["MPSRUN_TMPDIR"]) / f"mpsrun-{os.getuid()}"
    job = subprocess.Popen(job_argv(path, ["--timeout", "5"], fake("--report-dir", str(short_tmp), "--hold", "1"),
                                    ranks=2), stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, count=2, timeout=60)
    held = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        _, err = job.communicate(timeout=45)
    finally:
        os.close(held)
    assert job.returncode == 0, err
    assert f"the lock on {root}" in err and "turned away without it" in err, err
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


@pytest.mark.mpiexec
def test_per_node_under_a_real_mpiexec(fake_gpu, short_tmp):
    """mpiexec -n 3 mpsrun --per-node: the three local ranks share one daemon; nothing is left afterwards."""
    import shutil

    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    if mpiexec is None:
        pytest.skip("no mpiexec")
    out = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "mpsrun", "--per-node", "--mps", "on",
                          sys.executable, str(FAKECUDA), "--report-dir", str(short_tmp), "--hold", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = [json.loads(p.read_text()) for p in short_tmp.glob("*.json")]
    assert len(seen) == 3 and all(r["mps"] for r in seen)
    assert len({r["server"] for r in seen}) == 1
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


@pytest.mark.mpiexec
def test_hosts_run_through_mpiexec_with_a_session_per_host(fake_gpu, short_tmp):
    """mpsrun -np 3 --hosts localhost: mpiexec over the hosts, every rank through --per-node, one daemon per host."""
    import shutil

    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    if mpiexec is None:
        pytest.skip("no mpiexec")
    out = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "3", "--hosts", "localhost", "--mpiexec", mpiexec,
                          "--mps", "on", "--thread-percentage", "auto", sys.executable, str(FAKECUDA),
                          "--report-dir", str(short_tmp), "--hold", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = [json.loads(p.read_text()) for p in short_tmp.glob("*.json")]
    assert len(seen) == 3 and all(r["mps"] for r in seen) and len({r["server"] for r in seen}) == 1
    assert {r["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r in seen} == {"33"}
    assert leftovers(Path(os.environ["MPSRUN_TMPDIR"])) == []


def test_host_arguments_per_flavour(tmp_path):
    """Hosts are passed the way each MPI flavour takes them; an unknown flavour is a usage error."""
    from mpsrun.errors import ConfigError
    from mpsrun.job.mpiexec import host_arguments

    hostfile = tmp_path / "hf"
    hostfile.write_text("a:2\nb\n")
    assert host_arguments("openmpi", ["a", "b"]) == ["--host", "a,b"]
    assert host_arguments("mpich", hostfile=str(hostfile)) == ["-f", str(hostfile)]
    with pytest.raises(ConfigError, match="cannot tell how this mpiexec takes hosts"):
        host_arguments("unknown", ["a"])


def test_a_rank_beyond_the_jobs_size_is_refused():
    """A launcher that gives a rank's number but not the job's size, under -np 3: rank 5 is refused as impossible
    before anything starts (its size came from -np after the check, and rank 5 of 3 was welcomed and ran)."""
    config = parse_args(["--per-node", "-np", "3", "true"], environ={})
    with pytest.raises(ConfigError, match="rank 5 of 3"):
        run_per_node(config, {"PMI_RANK": "5", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})


def test_a_node_keeper_that_finds_the_jobs_command_gone_says_so_in_words():
    """Under --hosts a node keeper joins the job's command; one that finds no command there (a signal ended the job
    as its hosts' agents started) fails with words, not the socket error's repr ("node keeper failed:
    ConnectionRefusedError(111, ...)", found by a hostile pass)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(MPSError) as raised:
            join_command(f"tcp:127.0.0.1:{port}", "token")
    said = str(raised.value)
    assert said.startswith("the job's command has ended") and "Error(" not in said, said


def test_a_rank_refused_as_its_nodes_last_waits_until_the_keeper_is_gone(fake_gpu, tmp_path):
    """A rank refused (here for another -x) when every other rank of its node has ended is the node's last: its
    refusal closes the node's session, and the rank ends only after the node keeper has (it lingers, as the last
    rank to be told its verdict does). Before, the keeper closed the refused rank's connection at once, so the rank
    ended while the keeper was still tearing down (seen in CI as a keeper left behind by the test above)."""
    [node] = node_dirs(fake_gpu, ["A"]).values()
    first = start_rank(node, "A", 0, 0, 2)
    first.communicate(timeout=120)
    assert first.returncode == 0
    keeper = [p for p in fake_gpu.orphans() + psutil.Process().children(recursive=True)
              if "mpsrun.agent.keeper" in " ".join(p.cmdline())]
    assert len(keeper) == 1, keeper
    late = start_rank(node, "A", 1, 1, 2, options=["-x", "NAME=1"])
    _, err = late.communicate(timeout=120)
    assert late.returncode == 2 and "started with other mpsrun options" in err, err
    assert not keeper[0].is_running() or keeper[0].status() == psutil.STATUS_ZOMBIE
    assert leftovers(node) == []


@pytest.mark.mpiexec
def test_sigkill_to_mpiexec_under_per_node_leaves_nothing(fake_gpu, short_tmp):
    """SIGKILL to the mpiexec running per-node ranks: the node keeper sees every rank go, stops the daemons and
    removes the node's session; nothing is left on the node (no lock file either)."""
    job = subprocess.Popen(job_argv("per-node", ["--grace", "1"], [sys.executable, str(FAKECUDA), "--hold", "60",
                                                                   "--report-dir", str(short_tmp)]),
                           stderr=subprocess.DEVNULL)
    wait_ready(short_tmp, proc=job)
    job.kill()
    job.wait()
    settle(fake_gpu)
    root = fake_gpu.tmpdir / f"mpsrun-{os.getuid()}"
    assert sorted(p.name for p in root.iterdir()) == []


@pytest.mark.mpiexec
def test_per_node_applies_lists_by_rank_and_sets_world_size(fake_gpu, short_tmp):
    """--per-node takes a per-rank thread-percentage list by rank (never dropped) and sets WORLD_SIZE."""
    out = subprocess.run(job_argv("per-node", ["--mps", "on", "--thread-percentage", "10,20,30"],
                                  [sys.executable, str(FAKECUDA), "--report-dir", str(short_tmp)]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert {r: p["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r, p in seen.items()} == {0: "10", 1: "20", 2: "30"}
    assert {p["env"]["WORLD_SIZE"] for p in seen.values()} == {"3"} and all(p["mps"] for p in seen.values())
    settle(fake_gpu)


@pytest.mark.mpiexec
@pytest.mark.parametrize(("options", "message"), [
    (["--thread-percentage", "10,20"], "lists 2 values but there are 3 ranks"),
    (["-np", "4"], "-np 4, but the launcher started 3 ranks"),
])
def test_per_node_refuses_what_it_cannot_honour(fake_gpu, options, message):
    """A per-rank list of the wrong length, or an -np the launcher contradicts, is refused with exit 2."""
    out = subprocess.run(job_argv("per-node", options, [sys.executable, "-c", "pass"]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_a_leaked_per_node_session_is_cleaned_by_the_next(fake_gpu, short_tmp):
    """A node session whose keeper was SIGKILLed (its reaper too) is removed by the next per-node job on the node
    or by mpsrun cleanup, daemons included."""
    job = subprocess.Popen(job_argv("per-node", ["--grace", "1"], [sys.executable, str(FAKECUDA), "--hold", "60",
                                                                   "--report-dir", str(short_tmp)]),
                           stderr=subprocess.DEVNULL)
    wait_ready(short_tmp, proc=job)
    [root] = fake_gpu.session_dirs()
    record = json.loads((root / "session.json").read_text())
    keeper = psutil.Process(record["owner"]["pid"])
    reaper = descendants(keeper.pid, "mpsrun.session.reaper")
    for proc in (*reaper, keeper):
        proc.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    out = subprocess.run([sys.executable, "-m", "mpsrun", "cleanup"], capture_output=True, text=True, timeout=60)
    assert f"{root.name}: removed" in out.stdout, out.stdout + out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_per_node_ranks_that_end_before_others_join_still_share_one_verdict(fake_gpu):
    """Per-node ranks that finish before the node's others even join: one node session for all (the keeper waits
    for the ranks the launcher announced), one exit code (the first failure's), one summary."""
    out = subprocess.run(job_argv("per-node", [], ["sh", "-c", "exit $((RANK+3))"]), capture_output=True, text=True,
                         timeout=120)
    first = re.search(r"rank (\d) \(pid \d+\) exited with code (\d) first", out.stderr)
    assert first and int(first.group(2)) == int(first.group(1)) + 3, out.stderr
    assert out.returncode == int(first.group(2)) and out.stderr.count(" first") == 1, out.stderr
    assert "went away" not in out.stderr
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_per_node_first_rank_failing_at_once_stops_the_late_ones(fake_gpu):
    """Rank 0 fails before the others have joined: they are stopped (or refused) at once, not run to their end."""
    started = time.monotonic()
    out = subprocess.run(job_argv("per-node", ["--grace", "1"], ["sh", "-c", "[ $RANK = 0 ] && exit 9; sleep 30"],
                                  ranks=4), capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    assert time.monotonic() - started < 20
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_per_node_keeps_logs_and_the_next_job_keeps_them_too(fake_gpu):
    """--keep-logs under --per-node with instant ranks keeps the node's session and says where, once (a hostile pass
    saw it said twice); a later job leaves kept logs alone; mpsrun cleanup removes them."""
    out = subprocess.run(job_argv("per-node", ["--keep-logs"], ["true"]), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    [kept] = fake_gpu.session_dirs()
    assert f"kept session logs in {kept}" in out.stderr and out.stderr.count(str(kept)) == 1, out.stderr
    again = subprocess.run(job_argv("local", [], ["true"]), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and fake_gpu.session_dirs() == [kept]
    cleaned = subprocess.run([sys.executable, "-m", "mpsrun", "cleanup"], capture_output=True, text=True, timeout=60)
    assert f"{kept.name}: removed" in cleaned.stdout, cleaned.stdout
    settle(fake_gpu)


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", ["per-node", "hosts"])
def test_per_node_says_what_the_keeper_sees(fake_gpu, short_tmp, path):
    """Under --per-node the node keeper's words reach the user: a rank that misses the daemon under --mps auto is
    warned about (as under the launcher), through one of the node's ranks."""
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    program = ["sh", "-c", f'if [ $RANK = 2 ]; then export CUDA_MPS_PIPE_DIRECTORY={elsewhere}; fi; '
                           f'exec {sys.executable} {FAKECUDA} --hold 3']
    out = subprocess.run(job_argv(path, ["--mps", "auto"], program), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"rank 2 \(pid \d+\) uses GPU 0 without MPS", out.stderr), out.stderr
    settle(fake_gpu)
