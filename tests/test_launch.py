"""Integration tests: the mpsrun command end to end, against the fake MPS daemon and fake NVML.

Every test runs the real CLI in a subprocess; the fake_gpu fixture then checks that no
process of the job (rank, daemon, server) survived and that no session directory is left.
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import PATHS, PROGRAMS, fake, job_argv, mpiexec, mpsrun, reports, run_job, settle, wait_ready

PROBE = PROGRAMS / "mpi_probe.py"


def test_local_ranks_get_their_variables_and_are_mps_clients(fake_gpu, short_tmp):
    """-np 4 on one GPU: RANK 0..3, WORLD_SIZE 4, the GPU's UUID, our pipe dir, auto = 25%; all verified."""
    out = mpsrun("-np", 4, "--launcher", "local", "--thread-percentage", "auto", "-v",
                 *fake("--report-dir", short_tmp, "--hold", "3"))
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert sorted(seen) == [0, 1, 2, 3]
    pipes = {r["env"]["CUDA_MPS_PIPE_DIRECTORY"] for r in seen.values()}
    assert len(pipes) == 1
    for rank, report in seen.items():
        env = report["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank),
                                                                                                "4", "4")
        assert env["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0]
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert report["mps"] is True
    assert "4 of 4 ranks connected to MPS" in out.stderr


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
@pytest.mark.parametrize(("policy", "expected"), [("block", [0, 0, 1, 1]), ("round-robin", [0, 1, 0, 1])])
def test_ranks_are_placed_across_gpus(fake_gpu, short_tmp, policy, expected):
    """With two GPUs, --map-by block and round-robin put ranks on the expected GPUs, each with its daemon."""
    out = mpsrun("-np", 4, "--launcher", "local", "--map-by", policy, *fake("--report-dir", short_tmp))
    assert out.returncode == 0, out.stderr
    seen = reports(short_tmp)
    assert [fake_gpu.uuids.index(seen[r]["uuid"]) for r in range(4)] == expected
    assert all(report["mps"] for report in seen.values())
    pipes = {seen[r]["env"]["CUDA_MPS_PIPE_DIRECTORY"] for r in range(4)}
    assert len(pipes) == 2


def test_first_failing_rank_sets_the_exit_code(fake_gpu, short_tmp):
    """Rank 2 exits 7: mpsrun exits 7, names rank 2, and the other ranks are detached and stopped."""
    start = time.monotonic()
    out = mpsrun("-np", 4, "--launcher", "local", "--tag-output", "--grace", "2",
                 *fake("--hold", "60", "--fail-rank", "2", "--exit", "7", "--report-dir", str(short_tmp)))
    assert out.returncode == 7
    assert "rank 2 (pid" in out.stderr and "exited with code 7 first" in out.stderr
    assert time.monotonic() - start < 30
    # The survivors were MPS clients: terminate_client came first, so they saw the MPS error.
    assert out.stderr.count("cudaErrorMpsClientTerminated") >= 1


def test_rank_killed_by_signal_gives_128_plus_n(fake_gpu):
    """A rank killed by SIGKILL makes mpsrun exit 137 and say which rank and signal."""
    out = mpsrun("-np", 3, "--launcher", "local", *fake("--hold", "60", "--kill-rank", "1"))
    assert out.returncode == 137
    assert "rank 1" in out.stderr and "signal 9 (SIGKILL)" in out.stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_mpsrun_stops_everything(fake_gpu, short_tmp, sig, code):
    """SIGINT/SIGTERM to mpsrun reach the ranks; mpsrun exits 128+N and leaves no rank, daemon or directory."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsrun", "-np", "3", "--launcher", "local",
         *fake("--report-dir", str(short_tmp), "--hold", "60")],
        stderr=subprocess.PIPE, text=True,
    )
    wait_ready(short_tmp, proc=proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code
    assert f"received {signal.Signals(sig).name}" in err


def test_timeout_ends_the_job_with_124(fake_gpu):
    """--timeout 1 on ranks that run 60 s ends the job with exit 124 and its summary, long before the ranks' end (on
    a loaded machine the second may pass while the daemons start: the summary then says so)."""
    start = time.monotonic()
    out = mpsrun("-np", 2, "--launcher", "local", "--timeout", "1", "--grace", "1", *fake("--hold", "60"))
    assert out.returncode == 124 and "timed out after 1 s" in out.stderr, out.stderr
    assert time.monotonic() - start < 45, "the ranks' 60 s were waited out"


def test_tag_output_prefixes_whole_lines(fake_gpu):
    """--tag-output prefixes each line with its rank and never mixes two ranks inside one line."""
    code = "import os,sys\nfor i in range(200): print('x' * 50, os.environ['RANK'], i)\nsys.stdout.write('tail')"
    out = mpsrun("-np", 3, "--launcher", "local", "--tag-output", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 * 201
    for line in lines:
        rank = line.split("]")[0].removeprefix("[rank ")
        assert line == f"[rank {rank}] tail" or line.startswith(f"[rank {rank}] {'x' * 50} {rank} ")


def test_command_not_found_is_127_and_starts_nothing(fake_gpu):
    """A command that does not exist gives 127 with one line, before any daemon starts."""
    out = mpsrun("-np", 2, "no-such-program-xyz")
    assert out.returncode == 127
    assert out.stderr == "mpsrun: error: no-such-program-xyz: command not found\n"


def test_unknown_gpu_is_a_usage_error(fake_gpu):
    """--gpus 7 on a one-GPU machine exits 2 with the visible GPUs named."""
    out = mpsrun("-np", 2, "--gpus", "7", sys.executable, "-c", "pass")
    assert out.returncode == 2
    assert "GPU 7 is not visible" in out.stderr and out.stderr.count("\n") == 1


def test_wrong_length_percentage_list_is_refused(fake_gpu):
    """A per-rank percentage list of the wrong length exits 2 before anything starts."""
    out = mpsrun("-np", 3, "--thread-percentage", "10,20", sys.executable, "-c", "pass")
    assert out.returncode == 2 and "lists 2 values but there are 3 ranks" in out.stderr


def test_mps_on_without_driver_is_a_setup_failure(no_gpu):
    """--mps on where there is no NVIDIA driver exits 3 saying why."""
    out = mpsrun("--mps", "on", sys.executable, "-c", "pass")
    assert out.returncode == 3
    assert "MPS is required (mps='on') but unavailable: no usable NVIDIA driver" in out.stderr


def test_mps_auto_without_driver_runs_the_ranks(no_gpu):
    """--mps auto where there is no driver runs the ranks without MPS and says so once."""
    out = mpsrun("-np", 2, "--launcher", "local", sys.executable, "-c",  # one write: under PYTHONUNBUFFERED=1
                 "import os; os.write(1, os.environ['RANK'].encode() + b'\\n')")  # print() makes two, and they mix
    assert out.returncode == 0
    assert sorted(out.stdout.split()) == ["0", "1"]
    assert out.stderr.count("running without MPS") == 1


def test_mps_off_starts_no_daemon(fake_gpu, short_tmp):
    """--mps off pins GPUs but starts no daemon: ranks have no pipe directory and are not MPS clients."""
    out = mpsrun("-np", 2, "--mps", "off", "--launcher", "local", *fake("--report-dir", short_tmp))
    assert out.returncode == 0, out.stderr
    for report in reports(short_tmp).values():
        assert report["mps"] is False and "CUDA_MPS_PIPE_DIRECTORY" not in report["env"]
        assert report["env"]["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0]


@pytest.mark.parametrize(("mode", "code"), [("on", 3), ("auto", 0)])
def test_rank_that_misses_the_daemon_is_reported(fake_gpu, short_tmp, monkeypatch, mode, code):
    """A rank pointing its pipe directory elsewhere runs without MPS: an error with --mps on, a warning with auto.
    Each rank holds until NVML has been asked 8 times in its life (a rank is judged after two looks in a row, and
    the memory samples ask too): a fixed 4 s was too short for a loaded machine's looks."""
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("FAKE_NVML_LOOK_LOG", str(short_tmp / "looks"))
    command = ["env", f"CUDA_MPS_PIPE_DIRECTORY={elsewhere}", *fake("--hold", "1", "--until-looks", "8")]
    out = mpsrun("-np", 2, "--launcher", "local", "--mps", mode, "--grace", "1", *command)
    assert out.returncode == code, out.stderr
    assert "uses GPU 0 without MPS" in out.stderr
    if mode == "auto":  # the job goes on, so both ranks are found and named
        assert "rank 0 (pid" in out.stderr and "rank 1 (pid" in out.stderr
    else:  # the first one found stops the job
        assert "rank 0 (pid" in out.stderr or "rank 1 (pid" in out.stderr


def test_keep_logs_keeps_the_session(fake_gpu):
    """--keep-logs leaves the session directory with the daemon log and says where it is."""
    out = mpsrun("--keep-logs", "--launcher", "local", sys.executable, "-c", "pass")
    assert out.returncode == 0
    [root] = fake_gpu.session_dirs()
    assert (root / "gpu0" / "log" / "control.log").stat().st_size > 0
    assert f"kept session logs in {root}" in out.stderr
    shutil.rmtree(root)


@pytest.mark.mpiexec
def test_mpiexec_backend_gives_mpi4py_the_world(fake_gpu, short_tmp, monkeypatch):
    """--launcher mpiexec: mpi4py sees size N, each rank its rank, local rank and GPU variables."""
    pytest.importorskip("mpi4py")
    monkeypatch.setenv("PROBE_DIR", str(short_tmp))
    out = mpsrun("-np", 3, "--launcher", "mpiexec", "--mpiexec", mpiexec(), sys.executable, PROBE, timeout=120)
    assert out.returncode == 0, out.stderr
    probes = list(reports(short_tmp).values())
    assert sorted(p["rank"] for p in probes) == [0, 1, 2]
    for probe in probes:
        assert probe["size"] == 3 and probe["sum"] == 6
        env = probe["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(probe["rank"]) and env["WORLD_SIZE"] == "3"
        assert env["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0] and env["CUDA_MPS_PIPE_DIRECTORY"]


@pytest.mark.mpiexec
def test_mpiexec_backend_propagates_failure(fake_gpu, monkeypatch):
    """Under mpiexec, a rank exiting 7 makes mpsrun fail with 7 and name the rank, as under the local launcher."""
    pytest.importorskip("mpi4py")
    monkeypatch.setenv("PROBE_EXIT_RANK", "1")
    out = mpsrun("-np", 2, "--launcher", "mpiexec", "--mpiexec", mpiexec(), sys.executable, PROBE, timeout=120)
    assert out.returncode == 7, out.stderr
    # mpi4py's runner turns the rank's sys.exit(7) into MPI_Abort(7), and Hydra then ends every rank at once
    assert "mpiexec exited with code 7" in out.stderr or "rank 1 (pid" in out.stderr


def test_client_limit_refusal_is_explained(fake_gpu):
    """When the server refuses a client (its limit), mpsrun's summary says so in plain words."""
    fake_gpu.daemon_env(FAKE_MPS_MAX_CLIENTS="2")
    out = mpsrun("-np", 3, "--launcher", "local", "--grace", "1", *fake("--hold", "20"))
    assert out.returncode == 1
    assert "cudaErrorDevicesUnavailable" in out.stderr
    assert "the MPS server refused clients: maximum number of clients (2) reached" in out.stderr


def test_more_ranks_than_the_client_limit_warns_first(fake_gpu):
    """Asking for more ranks on one GPU than an MPS server accepts (48) is warned about up front."""
    out = mpsrun("-np", 49, "--launcher", "local", "true")
    assert out.returncode == 0
    assert "49 ranks share GPU 0, but an MPS server accepts at most 48 clients" in out.stderr


def test_output_filename_that_cannot_be_made_is_one_line(fake_gpu, tmp_path):
    """A DIR that cannot be made (a file is in the way) is one line and exit 3, before any rank starts."""
    (tmp_path / "file").write_text("")
    out = mpsrun("--output-filename", tmp_path / "file" / "out", "-np", "2", "--launcher", "local", "true")
    assert out.returncode == 3, out.stderr
    assert out.stderr.count("\n") == 1 and "--output-filename" in out.stderr, out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_output_filename_gives_each_rank_its_files(path, fake_gpu, tmp_path):
    """``--output-filename DIR``: rank N's stdout and stderr go to DIR/rank.N/stdout and DIR/rank.N/stderr, in
    directories made with the user's umask; nothing of the ranks' reaches the terminal."""
    target = tmp_path / "out"
    code = "import os, sys; print('out', os.environ['RANK']); print('err', os.environ['RANK'], file=sys.stderr)"
    out = run_job(path, ["--output-filename", str(target)], [sys.executable, "-c", code], ranks=3)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and "err " not in out.stderr
    umask = os.umask(0)
    os.umask(umask)
    for rank in range(3):
        directory = target / f"rank.{rank}"
        assert (directory / "stdout").read_text() == f"out {rank}\n"
        assert (directory / "stderr").read_text() == f"err {rank}\n"
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_awkward_arguments_reach_the_rank_intact(fake_gpu, launcher):
    """Spaces, quotes, ;, $(...), globs and non-UTF-8 bytes reach the rank unchanged: no shell anywhere."""
    if launcher == "mpiexec" and shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("no mpiexec")
    awkward = ["a b", '"quoted"', "it's", "x;y", "$(touch /tmp/mpsrun-pwned)", "*", "\\n", os.fsdecode(b"caf\xe9")]
    code = "import os, sys; sys.stdout.buffer.write(repr([os.fsencode(a) for a in sys.argv[1:]]).encode())"
    args = ["-np", "1", "--launcher", launcher]
    if launcher == "mpiexec":
        args += ["--mpiexec", shutil.which("mpiexec", path=os.path.dirname(sys.executable))]
    out = subprocess.run([sys.executable, "-m", "mpsrun", *args, sys.executable, "-c", code, *awkward],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == repr([os.fsencode(a) for a in awkward])
    assert not Path("/tmp/mpsrun-pwned").exists()


def test_two_jobs_at_once_on_the_same_gpu_each_get_their_own_daemon(fake_gpu, short_tmp):
    """Two mpsrun jobs on one GPU at the same time: separate daemons and directories, both succeed."""
    reports = [short_tmp / "a", short_tmp / "b"]
    for directory in reports:
        directory.mkdir()
    jobs = [subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local",
                              *fake("--report-dir", str(d), "--hold", "2")]) for d in reports]
    assert [job.wait(timeout=60) for job in jobs] == [0, 0]
    pipes = [{json.loads(p.read_text())["env"]["CUDA_MPS_PIPE_DIRECTORY"] for p in d.glob("*.json")} for d in reports]
    assert len(pipes[0]) == len(pipes[1]) == 1 and pipes[0] != pipes[1]


@pytest.mark.mpiexec
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


@pytest.mark.mpiexec
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
