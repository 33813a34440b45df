"""MPI programs under mpsrun, on every path: mpi4py's collectives with and without a GPU, a failing rank that
stops the others (its own words and code), MPI_Abort slow or turned off, a rank killed after MPI_Init ending with
128+S under --per-node. Against the fake GPU with MPICH's mpiexec; the GPU tier runs them under Open MPI.
"""

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
    PATHS,
    PROGRAMS,
    job_argv,
    mpiexec,
    reports,
    settle,
    wait_for,
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


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
