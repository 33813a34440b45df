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
from conftest import FAKECUDA, TESTS
from test_contract import PATHS, job_argv, mpiexec, settle, wait_ready

pytestmark = pytest.mark.mpiexec

PROBE = TESTS / "programs" / "mpi_probe.py"


def reports(directory):
    return {int(p.stem): json.loads(p.read_text()) for p in Path(directory).glob("*.json")}


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


@pytest.mark.parametrize("failure", ["raise", "exit"])
@pytest.mark.parametrize("path", PATHS)
def test_an_mpi4py_rank_that_fails_stops_the_others(fake_gpu, path, failure):
    """An mpi4py program whose rank 1 raises or calls sys.exit(7) while the others wait in a collective used to hang
    in MPI_Finalize under mpiexec. Run through mpi4py's runner, it aborts: the job exits with rank 1's code on every
    path, naming rank 1, or under an MPI launcher the launcher that took every rank down with it."""
    pytest.importorskip("mpi4py")
    end = "raise RuntimeError('rank 1 fails')" if failure == "raise" else "sys.exit(7)"
    code = f"import os, sys, time\nfrom mpi4py import MPI\nif os.environ['RANK'] == '1':\n    time.sleep(0.5); {end}\n" \
           "MPI.COMM_WORLD.Barrier()\ntime.sleep(30)"
    started = time.monotonic()
    out = subprocess.run(job_argv(path, ["--grace", "1"], [sys.executable, "-c", code]), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == (1 if failure == "raise" else 7), out.stderr
    if path != "per-node":  # there the launcher's own report is all there is
        assert re.search(r"rank 1 \(pid \d+\) exited with code \d first|mpiexec exited with code", out.stderr)
    assert time.monotonic() - started < 30
    settle(fake_gpu)


def test_mpi4py_abort_off_runs_the_command_as_given(fake_gpu, short_tmp):
    """--mpi4py-abort off: a Python rank is not run through mpi4py's runner (its sys.argv and -m mpi4py absent)."""
    pytest.importorskip("mpi4py")
    code = "import sys; print(sys.orig_argv[1:3])"
    runs = {}
    for switch in ("on", "off"):
        out = subprocess.run(job_argv("local", ["--mpi4py-abort", switch], [sys.executable, "-c", code], ranks=1),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs[switch] = out.stdout.strip()
    assert runs == {"on": "['-m', 'mpi4py']", "off": "['-c', 'import sys; print(sys.orig_argv[1:3])']"}


@pytest.mark.parametrize("path", PATHS)
def test_a_grandchild_that_ignores_sigterm_does_not_survive(fake_gpu, short_tmp, monkeypatch, path):
    """When the job stops, a rank's child that ignores SIGTERM is killed with the rank's process group."""
    monkeypatch.setenv("MARK", str(short_tmp))
    code = ("import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import os, signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(os.environ[\"MARK\"] + \"/\" + os.environ[\"RANK\"], \"w\").write(str(os.getpid())); "
            "time.sleep(300)'])\n"
            "time.sleep(1.5)\n"
            "if os.environ['RANK'] == '1':\n    sys.exit(7)\n"
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
    reaper = [p for p in keeper.children() if "mpsrun.reaper" in " ".join(p.cmdline())]
    for proc in (*reaper, keeper):
        proc.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    out = subprocess.run([sys.executable, "-m", "mpsrun", "cleanup"], capture_output=True, text=True, timeout=60)
    assert f"{root.name}: removed" in out.stdout, out.stdout + out.stderr
    settle(fake_gpu)
