"""What was measured broken off the local launcher, each as a test on every path it concerned.

MPICH programs under --per-node and --hosts, per-node leaks after kills, fail-fast under the
mpiexec launcher (mpi4py programs included), grandchildren, per-node options, MPI programs on a
machine without a GPU. The fault matrix itself is tests/test_contract.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    FAKECUDA,
    PATHS,
    PROGRAMS,
    daemon_session,
    descendants,
    job_argv,
    mpiexec,
    reports,
    settle,
    supervisors,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.mpiexec

PROBE = PROGRAMS / "mpi_probe.py"


@pytest.mark.parametrize("mps", ["auto", "off"])
@pytest.mark.parametrize("path", PATHS)
def test_mpi4py_allreduce_runs_on_every_path(fake_gpu, short_tmp, monkeypatch, path, mps):
    """An mpi4py program doing Allreduce runs on every path (under --per-node and --hosts Hydra's PMI_FD reaches
    it), sees the world its launcher made, and gets RANK and WORLD_SIZE."""
    pytest.importorskip("mpi4py")
    monkeypatch.setenv("PROBE_DIR", str(short_tmp))
    out = subprocess.run(job_argv(path, ["--mps", mps], [sys.executable, str(PROBE)]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    world = 1 if path == "local" else 3  # local ranks are separate one-rank MPI worlds
    assert len(seen) == world and all(p["size"] == world and p["sum"] == world * (world + 1) // 2
                                      for p in seen.values())
    for probe in seen.values():
        assert probe["env"]["WORLD_SIZE"] == "3" and probe["env"]["RANK"] is not None
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_mpi4py_allreduce_without_a_gpu(no_gpu, monkeypatch, path):
    """On a machine with no driver and no control program, --mps off and auto run the MPI program on every path."""
    pytest.importorskip("mpi4py")
    bin_dir = Path(os.environ["PATH"])
    (bin_dir / "mpiexec").symlink_to(mpiexec())  # only mpiexec is on PATH
    monkeypatch.setenv("PROBE_DIR", str(no_gpu))
    for mps in ("off", "auto"):
        out = subprocess.run(job_argv(path, ["--mps", mps], [sys.executable, str(PROBE)]), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr


#: How rank 1 fails: its code, the exit code the job then has, and the summary's words for it.
FAILURES = {
    "raise": ("raise RuntimeError('rank 1 fails')", 1, "uncaught RuntimeError: rank 1 fails"),
    "exit": ("sys.exit(7)", 7, "sys.exit(7)"),
    # An exit status is a byte: 256 would read as success (per-node exited 0), and 10**30 broke mpi4py.
    "exit-256": ("sys.exit(256)", 1, "sys.exit(256)"),
    "exit-huge": ("sys.exit(10**30)", 1, f"sys.exit({10**30})"),
    # Reported as what it is (the summary named another rank's lost supervisor, or said nothing under --per-node).
    "interrupt": ("raise KeyboardInterrupt", 130, "uncaught KeyboardInterrupt"),
    # A message UTF-8 cannot hold, and one whose __str__ fails, crashed the runner.
    "unencodable": ("raise ValueError(b'bad \\xff'.decode('utf-8', 'surrogateescape'))", 1,
                    "uncaught ValueError: bad \\udcff"),
    "unprintable": ("class Odd(Exception):\n        __str__ = None\n    raise Odd()", 1, "uncaught Odd"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("path", PATHS)
def test_an_mpi4py_rank_that_fails_stops_the_others(fake_gpu, path, failure, short_tmp):
    """An mpi4py program whose rank 1 fails (as FAILURES lists) while the others wait in a collective used to hang
    in MPI_Finalize under mpiexec. Run through mpi4py's runner, it aborts: the job exits with rank 1's code on every
    path, and the one summary names rank 1, its code and why, before MPI_Abort ends every process (it named another
    rank's lost supervisor on the mpiexec and --hosts paths, 8 of 15 times a rank that did not fail, and said nothing
    at all under --per-node). What rank 1 started in the background ends with it (it outlived the job on every MPI
    path)."""
    pytest.importorskip("mpi4py")
    end, code, why = FAILURES[failure]
    child = short_tmp / "child.pid"
    source = f"import os, subprocess, sys, time\nfrom mpi4py import MPI\nif os.environ['RANK'] == '1':\n" \
             f"    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n" \
             f"    open({str(child)!r}, 'w').write(str(child.pid))\n    time.sleep(0.5)\n    {end}\n" \
             "MPI.COMM_WORLD.Barrier()\ntime.sleep(30)"
    started = time.monotonic()
    out = subprocess.run(job_argv(path, ["--grace", "1"], [sys.executable, "-c", source]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == code, out.stderr
    # Under the local launcher each rank is an MPI world of its own, which rank 0 says first (test_mpi_world.py).
    said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun") and "MPI world" not in line]
    assert len(said) == 1 and re.fullmatch(rf"mpsrun: rank 1 \(pid \d+\) exited with code {code} first: "
                                           rf"{re.escape(why)}, then MPI_Abort", said[0]), out.stderr
    assert time.monotonic() - started < 30
    pid = int(child.read_text())
    try:
        wait_for(lambda: ended(pid), timeout=10, what="rank 1's child outlived the job")
    finally:
        if not ended(pid):
            os.kill(pid, signal.SIGKILL)
    settle(fake_gpu)


def test_a_per_node_rank_whose_mpi_abort_is_slow_gives_its_code(fake_gpu, short_tmp):
    """Under --per-node with Hydra, a Python rank that calls sys.exit(7) and reaches MPI_Abort only 0.5 s after its
    supervisor reported it (within ABORT_WAIT) still ends the job with 7 and one summary line. Its supervisor closed
    its link at the verdict, so its node keeper stopped the other ranks at once; the first of their supervisors to exit
    closed its PMI connection, and Hydra SIGKILLed every process before the MPI_Abort came: mpiexec exited 9 (its
    exit statuses ORed, 7 << 8 | SIGKILL), every time with this delay and now and then under load without it."""
    pytest.importorskip("mpi4py")
    source = ("import atexit, os, sys, time\nfrom mpi4py import MPI\nif os.environ['RANK'] == '1':\n"
              "    atexit.register(time.sleep, 0.5)  # runs before mpi4py's MPI_Abort at exit\n    sys.exit(7)\n"
              "MPI.COMM_WORLD.Barrier()\ntime.sleep(30)")
    started = time.monotonic()
    out = subprocess.run(job_argv("per-node", ["--grace", "1"], [sys.executable, "-c", source]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 7, out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert len(said) == 1 and re.fullmatch(r"mpsrun: rank 1 \(pid \d+\) exited with code 7 first: sys.exit\(7\), "
                                           r"then MPI_Abort", said[0]), out.stderr
    assert time.monotonic() - started < 30
    settle(fake_gpu)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_standard_input_goes_to_rank_0(fake_gpu, path):
    """mpsrun's stdin reaches rank 0, as under mpirun, through the local launcher and the default one (MPICH's
    Hydra); under the local launcher the other ranks read an empty stdin (Hydra never ends theirs: they do not read
    it here). docs/command-line.md says so (it did not)."""
    code = ("import os, sys\nif os.environ['RANK'] == '0' or sys.argv[1] == 'local':\n"
            "    os.write(1, f\"{os.environ['RANK']} read {sys.stdin.read()!r}\\n\".encode())\n")
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", code, path], ranks=3), input="hello\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = ["0 read 'hello\\n'"] + (["1 read ''", "2 read ''"] if path == "local" else [])
    assert sorted(out.stdout.splitlines()) == expected, out.stdout
    settle(fake_gpu)


def test_mpi4py_abort_off_runs_the_command_as_given(fake_gpu, short_tmp):
    """--mpi4py-abort off: a Python rank is not run through mpsrun's mpi4py runner (-m mpsrun.rank.pyrun absent)."""
    pytest.importorskip("mpi4py")
    code = "import sys; print(sys.orig_argv[1:3])"
    runs = {}
    for switch in ("on", "off"):
        out = subprocess.run(job_argv("local", ["--mpi4py-abort", switch], [sys.executable, "-c", code], ranks=1),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs[switch] = out.stdout.strip()
    assert runs == {"on": "['-m', 'mpsrun.rank.pyrun']", "off": "['-c', 'import sys; print(sys.orig_argv[1:3])']"}


@pytest.mark.parametrize("path", PATHS)
def test_a_grandchild_that_ignores_sigterm_does_not_survive(fake_gpu, short_tmp, monkeypatch, path):
    """When the job stops, a rank's child that ignores SIGTERM is killed with the rank's process group."""
    monkeypatch.setenv("MARK", str(short_tmp))
    code = ("import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import os, signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "mark = os.environ[\"MARK\"] + \"/\" + os.environ[\"RANK\"]; "
            "open(mark + \".tmp\", \"w\").write(str(os.getpid())); os.rename(mark + \".tmp\", mark); "
            "time.sleep(300)'])\n"
            "if os.environ['RANK'] == '1':  # once every rank's child ignores SIGTERM\n"
            "    end = time.monotonic() + 60\n"
            "    while sum(n.isdigit() for n in os.listdir(os.environ['MARK'])) < 3 and time.monotonic() < end:\n"
            "        time.sleep(0.02)\n"
            "    sys.exit(7)\n"
            "time.sleep(300)\n")
    out = subprocess.run(job_argv(path, ["--grace", "1"], [sys.executable, "-c", code]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 7, out.stderr
    children = [int(p.read_text()) for p in short_tmp.iterdir() if p.name.isdigit()]
    assert len(children) == 3
    settle(fake_gpu)
    assert not [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


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


# -- found by an adversarial pass over the README's promises ------------------------------------


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


def test_per_node_first_rank_failing_at_once_stops_the_late_ones(fake_gpu):
    """Rank 0 fails before the others have joined: they are stopped (or refused) at once, not run to their end."""
    started = time.monotonic()
    out = subprocess.run(job_argv("per-node", ["--grace", "1"], ["sh", "-c", "[ $RANK = 0 ] && exit 9; sleep 30"],
                                  ranks=4), capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    assert time.monotonic() - started < 20
    settle(fake_gpu)


@pytest.mark.parametrize("path", ["local", "mpiexec"])
def test_twenty_instantly_failing_ranks(fake_gpu, path):
    """20 ranks that all fail at once: the first failure's code, one line, no traceback (descriptor reuse)."""
    out = subprocess.run(job_argv(path, [], ["sh", "-c", "exit 3"], ranks=20), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count(" first") == 1, out.stderr
    settle(fake_gpu)


SLOW_CLEANUP = ("import os, signal, sys, time\n"
                "def stop(*_):\n"
                "    time.sleep(2); open(os.path.join(os.environ['MARK'], os.environ['RANK']), 'w').close(); sys.exit(0)\n"
                "signal.signal(signal.SIGINT, stop)\n"
                "open(os.path.join(os.environ['MARK'], 'ready' + os.environ['RANK']), 'w').close()\n"
                "time.sleep(60)\n")


@pytest.mark.parametrize("path", ["per-node", "mpiexec"])
def test_one_interrupt_per_rank_is_not_a_second_ctrl_c(fake_gpu, short_tmp, monkeypatch, path):
    """srun (and Hydra for its mpiexec) hands one SIGINT to every rank: that is one interrupt, so the ranks get
    their --grace to clean up instead of being killed at once."""
    monkeypatch.setenv("MARK", str(short_tmp))
    job = subprocess.Popen(job_argv(path, ["--grace", "10"], [sys.executable, "-c", SLOW_CLEANUP]),
                           stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, pattern="ready*", proc=job)
    if path == "per-node":
        targets = supervisors(job, path)
    else:
        targets = [p.pid for p in psutil.Process(job.pid).children() if "mpiexec" in p.name()]
    for pid in targets:
        os.kill(pid, signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert sorted(p.name for p in short_tmp.iterdir() if p.name.isdigit()) == ["0", "1", "2"], err
    assert "second interrupt" not in err
    settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_a_file_that_cannot_be_executed_gives_126(fake_gpu, short_tmp, path):
    """A command that exists but cannot be executed gives 126 (as a shell does), not 127."""
    script = short_tmp / "noexec.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    out = subprocess.run(job_argv(path, [], [str(script)]), capture_output=True, text=True, timeout=120)
    assert out.returncode == 126, out.stderr
    assert "Permission denied" in out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("log", ["as it was", "with a 20 MB last line"])
@pytest.mark.parametrize("path", PATHS)
def test_the_daemon_dying_under_the_job_gives_3(fake_gpu, short_tmp, path, log):
    """The MPS daemon killed under running ranks: exit 3 on every path, the summary says the daemon died, quoting
    its log's last line cut to a line of ours. With a 20 MB last line (a rank can write the log) a node keeper's
    word was past what its link takes: --per-node exited 143 without a word, --hosts 137 blaming the keeper."""
    from mpsrun.runtime.output import LINE_MOST

    job = subprocess.Popen(job_argv(path, ["--grace", "1"], [sys.executable, str(FAKECUDA), "--hold", "60",
                                                             "--report-dir", str(short_tmp)]),
                           stderr=subprocess.PIPE, text=True)
    wait_ready(short_tmp, proc=job)
    root = daemon_session(fake_gpu)
    if log != "as it was":
        with (root / "gpu0" / "log" / "control.log").open("a") as stream:
            stream.write("x" * 20_000_000)
    daemon = json.loads((root / "session.json").read_text())["daemons"][0]["process"]["pid"]
    os.killpg(daemon, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3, err[:3000]
    assert "MPS control daemon of GPU 0 died under the job" in err and max(map(len, err.splitlines())) <= LINE_MOST
    settle(fake_gpu)


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


def test_a_long_tagged_line_stays_one_line(fake_gpu):
    """--tag-output keeps a 200 kB line as one tagged line (pieces only past 1 MiB)."""
    code = "import sys; sys.stdout.write('x' * 200000 + '\\n')"
    out = subprocess.run(job_argv("local", ["--tag-output"], [sys.executable, "-c", code], ranks=2),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(len(line) for line in out.stdout.splitlines()) == [200009, 200009]
    settle(fake_gpu)


#: One rank's ``mpsrun --per-node`` run by a parent that keeps the launcher's descriptors (PMI_FD), and says how that
#: mpsrun ended; the MPI launcher then sees this parent's status.
PER_NODE_RANK = ("import os, subprocess, sys\n"
                 "code = subprocess.run([sys.executable, '-m', 'mpsrun', '--per-node', *sys.argv[1:]],"
                 " close_fds=False).returncode\n"
                 "print('ENDED', os.environ['PMI_RANK'], code, file=sys.stderr, flush=True)\nsys.exit(code)\n")
#: After an MPI barrier rank 2 is killed by ``sys.argv[1]`` (a signal's number); the others wait to be stopped.
KILLED_AFTER_MPI = ("import os, sys, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                    "if os.environ['RANK'] == '2':\n    time.sleep(0.3)\n    os.kill(os.getpid(), int(sys.argv[1]))\n"
                    "time.sleep(30)\n")


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_a_per_node_rank_killed_after_mpi_init_ends_with_128_plus_s(fake_gpu, sig):
    """Under ``mpiexec -n 4 mpsrun --per-node`` a rank killed by signal S after an mpi4py barrier: its mpsrun exits
    128+S and says so, as on the other paths. The launcher's own status is the launcher's: MPICH's Hydra SIGKILLs the
    job's other processes once one exits without MPI_Finalize, and reports 9 (docs/command-line.md, Exit status)."""
    pytest.importorskip("mpi4py")
    out = subprocess.run([mpiexec(), "-n", "4", sys.executable, "-c", PER_NODE_RANK, "--mps", "off", sys.executable,
                          "-c", KILLED_AFTER_MPI, str(int(sig))], capture_output=True, text=True, timeout=120)
    ended = dict(line.split()[1:] for line in out.stderr.splitlines() if line.startswith("ENDED"))
    assert ended.get("2") == str(128 + sig), out.stderr
    assert "rank 2 (pid" in out.stderr and f"was killed by signal {int(sig)} ({sig.name}) first" in out.stderr, \
        out.stderr
    settle(fake_gpu)
