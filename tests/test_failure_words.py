"""A failed rank is summed up with its cause, in one line, when CUDA or NCCL said it where mpsrun asked (issue 35).

CUDA 12.9 and later write every failed call to CUDA_LOG_FILE; NCCL writes its warnings to NCCL_DEBUG_FILE when
NCCL_DEBUG is set. mpsrun points both into the session directory (unless the caller set them) and reads them when a
rank fails. The fake CUDA program writes the lines real CUDA wrote on an H100 (driver 580); the GPU tier checks the
real ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PATHS, fake, gpu_job_argv, job_argv, reports, run_job, settle, wait_ready

from mpsrun.runtime.constants import SESSION_DIR_VARIABLE


def summary(out: subprocess.CompletedProcess[str]) -> str:
    """mpsrun's one line on stderr (the test fails if there are more)."""
    said = [line for line in out.stderr.splitlines() if line.startswith("mpsrun")]
    assert len(said) == 1, out.stderr
    return said[0]


@pytest.fixture
def clean(monkeypatch):
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_FILE", "CUDA_LOG_FILE", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("path", PATHS)
def test_local_rank_used_as_a_device_index_is_explained(path, fake_gpu, clean):
    """Two ranks on one GPU, each using LOCAL_RANK as its CUDA device (as the DDP tutorial does): rank 1 has no device
    1, and the summary says so with the two ways out (it said only 'rank 1 exited with code 1 first')."""
    out = run_job(path, [], [*fake("--device", "local", "--hold", "30")], ranks=2)
    assert out.returncode == 1
    line = summary(out)
    assert "rank 1 (pid" in line and "exited with code 1 first: it asked CUDA for device 1 and sees 1 GPU " \
        "(LOCAL_RANK as a device index): run with --gpu-bind none for one rank per GPU, or --local-rank device " \
        "where ranks share a GPU" in line, line
    assert settle(fake_gpu)


def test_the_fix_the_summary_names_works(fake_gpu, clean):
    """The same ranks under --local-rank device both run on the GPU they share."""
    out = run_job("local", ["--local-rank", "device"], fake("--device", "local"), ranks=2)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_a_client_the_mps_server_ended_is_said_as_such(path, fake_gpu, clean, short_tmp):
    """The MPS server ends rank 1's client (asked by someone else: terminate_client): the summary names rank 1 and
    CUDA's word for it, and nothing is said of a signal (on the H100 the ranks' 'terminated by the server' errors were
    taken for mpsrun's own, and a signal to mpsrun was reported)."""
    argv = job_argv(path, [], fake("--hold", "60", "--report-dir", str(short_tmp)), ranks=2)
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(short_tmp, 2, proc=job)
        victim = reports(short_tmp)[1]
        control = subprocess.run(["nvidia-cuda-mps-control"], input=f"terminate_client {victim['server']} "
                                 f"{victim['pid']}\n", capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": victim["daemon"]})
        assert control.stdout.strip() == "0", control
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
        job.wait()
    line = summary(subprocess.CompletedProcess([], job.returncode, out, err))
    assert job.returncode == 1 and "rank 1 (pid" in line, err
    assert "CUDA said CUDA_ERROR_MPS_CLIENT_TERMINATED (cuCtxSynchronize_v2): the MPS server ended its CUDA " \
           "client" in line, line
    assert "received" not in err and "signal" not in line, err
    assert settle(fake_gpu)


def test_mpsruns_own_detaching_is_said_with_v(fake_gpu, clean):
    """A job stopped by its --timeout detaches its ranks from MPS before signalling them; with -v mpsrun says so, and
    that their CUDA calls then fail as ended by the server (on the H100 each rank's 'the MPS client has been
    terminated by the server' looked like the server's own doing)."""
    out = run_job("local", ["-v", "--timeout", "8"], fake("--hold", "60"), ranks=2)  # (both ranks clients by then)
    assert out.returncode == 124, out.stderr
    assert "mpsrun: detached 2 rank process(es) from MPS before stopping them: their CUDA calls now fail with " \
           "CUDA_ERROR_MPS_CLIENT_TERMINATED" in out.stderr, out.stderr
    assert settle(fake_gpu)


#: NCCL as it fails when two ranks share a GPU: the communicator's rank 0 says its version as it starts, before the
#: ranks meet; each then warns where NCCL_DEBUG_FILE says (%h: the host, %p: the pid) when NCCL_DEBUG is set, and
#: every rank raises "invalid usage".
FAKE_NCCL = """
import glob, os, socket, sys, time
version, refusal = sys.argv[1], sys.argv[2]
if os.environ.get("NCCL_DEBUG") == "WARN" and os.environ.get("NCCL_DEBUG_FILE"):
    path = os.environ["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    with open(path, "w") as log:
        if os.environ["RANK"] == "0":
            log.write(f"NCCL version {version}+cuda13.0\\n")
    logs = os.path.join(os.path.dirname(path), "nccl.*.log")
    while not any("NCCL version" in open(name).read() for name in glob.glob(logs)):  # the ranks meet
        time.sleep(0.01)
    with open(path, "a") as log:
        log.write(f"{socket.gethostname()}:{os.getpid()} [0] init.cc:904 NCCL WARN {refusal}\\n")
sys.exit("torch.distributed.DistBackendError: NCCL error: invalid usage")
"""
DUPLICATE = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60"
MULTI_RANK = ("Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this "
              "configuration.")  # NCCL 2.31.2's words, on the H100


@pytest.mark.parametrize("path", PATHS)
def test_an_nccl_too_old_for_a_shared_gpu_is_named_with_the_remedy(path, fake_gpu, clean):
    """Ranks that share a GPU fail in an NCCL older than 2.30: the summary names the version NCCL loaded, says that
    2.30 can and how to get it, or gloo (it named no version, and said NCCL could not at all)."""
    out = run_job(path, [], [sys.executable, "-c", FAKE_NCCL, "2.28.9", DUPLICATE], ranks=2)
    assert out.returncode == 1
    assert "NCCL 2.28.9 cannot put several ranks on one GPU; NCCL 2.30 or newer can (pip install " \
           "'nvidia-nccl-cu13>=2.30', docs/frameworks.md), or use the gloo backend" in summary(out), out.stderr
    assert settle(fake_gpu)


def test_a_newer_nccl_told_not_to_share_says_what_it_needs(fake_gpu, clean, monkeypatch):
    """An NCCL of 2.30 or later whose multi-rank switch the caller turned off refuses too: the summary names the
    switch."""
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")
    out = run_job("local", [], [sys.executable, "-c", FAKE_NCCL, "2.31.2", MULTI_RANK], ranks=2)
    assert "NCCL 2.31.2 puts several ranks on one GPU only with NCCL_MULTI_RANK_GPU_ENABLE=1" in summary(out)


def test_the_callers_logs_are_left_alone(fake_gpu, clean, monkeypatch, short_tmp):
    """A caller who set NCCL_DEBUG or CUDA_LOG_FILE keeps them as they are: mpsrun sets no NCCL_DEBUG_FILE and no
    CUDA_LOG_FILE of its own, and reads neither."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_LOG_FILE", str(short_tmp / "mine.log"))
    show = "import os; os.write(1, f\"{os.environ.get('NCCL_DEBUG')} {os.environ.get('NCCL_DEBUG_FILE')} " \
           "{os.environ.get('CUDA_LOG_FILE')}\\n\".encode())"  # one write: print()'s newline apart mixes ranks
    out = run_job("local", [], [sys.executable, "-c", show], ranks=2)
    assert out.returncode == 0 and out.stdout.splitlines() == [f"INFO None {short_tmp / 'mine.log'}"] * 2, out.stderr
    out = run_job("local", [], fake("--device", "local"), ranks=2)
    assert "asked CUDA" not in out.stderr and "rank 1 (pid" in summary(out)


@pytest.mark.parametrize("path", ["local", "per-node"])
def test_each_rank_has_its_own_cuda_log_in_the_session(path, fake_gpu, clean):
    """Every rank, on a GPU of its own or not, gets CUDA_LOG_FILE: a file of its own in the session directory."""
    show = ("import os; os.write(1, ' '.join([os.environ['RANK'], os.environ['CUDA_LOG_FILE'], "
            f"os.environ['{SESSION_DIR_VARIABLE}']]).encode() + b'\\n')")  # one write, as above
    out = run_job(path, [], [sys.executable, "-c", show], ranks=2)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        rank, log, session = line.split()
        assert log == os.path.join(session, f"cuda.{rank}.log")


#: Rank 1 replaces a log mpsrun reads with something that never ends (a FIFO blocks an open; /dev/zero has no end).
PLANT = """
import os, sys, time
log = os.environ['CUDA_LOG_FILE'] if sys.argv[1] == 'cuda' else os.environ['MPSRUN_SESSION_DIR'] + '/nccl.x.log'
if os.environ['RANK'] == '1':
    os.mkfifo(log) if sys.argv[2] == 'fifo' else os.symlink('/dev/zero', log)
    sys.exit(3)
time.sleep(30)
"""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("log", ["cuda", "nccl"])
@pytest.mark.parametrize("plant", ["fifo", "zero"])
def test_a_log_a_rank_replaced_is_not_read(path, log, plant, fake_gpu, clean):
    """A rank that makes its CUDA or NCCL log a FIFO, or a symlink to /dev/zero, before it fails gets its plain
    summary: mpsrun's read neither blocks (the job hung for ever) nor runs out of memory (the kernel killed it)."""
    out = run_job(path, [], [sys.executable, "-c", PLANT, log, plant], ranks=2, timeout=60)
    assert out.returncode == 3, out.stderr
    assert "rank 1 (pid" in summary(out) and "exited with code 3 first" in summary(out)


# -- the GPU tier -------------------------------------------------------------------------------------------------

#: torch as the DDP tutorial starts: LOCAL_RANK is the device.
TORCH_LOCAL_RANK = "import os, torch; torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); print(torch.ones(1).cuda())"


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_torchs_invalid_device_ordinal_is_explained(path, monkeypatch):
    """Two torch ranks on GPU 0 set LOCAL_RANK as their device: rank 1 fails with CUDA's 'invalid device ordinal', and
    the summary says in one line that it asked for device 1 and sees 1 GPU, and what to run instead."""
    pytest.importorskip("torch")
    monkeypatch.delenv("CUDA_LOG_FILE", raising=False)
    out = subprocess.run(gpu_job_argv(path, [], [sys.executable, "-c", TORCH_LOCAL_RANK], ranks=2),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "rank 1 (pid" in summary(out) and "it asked CUDA for device 1 and sees 1 GPU (LOCAL_RANK as a device " \
        "index)" in summary(out), out.stderr
    out = subprocess.run(gpu_job_argv(path, ["--local-rank", "device"], [sys.executable, "-c", TORCH_LOCAL_RANK],
                                      ranks=2), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


#: A CuPy rank that says where it is (its pid and its MPS pipe directory) and computes until stopped.
CUPY_BUSY = """
import json, os, sys, time, cupy
x = cupy.ones(1 << 16, dtype=cupy.float32)
cupy.cuda.Device().synchronize()
report = {"pid": os.getpid(), "daemon": os.environ["CUDA_MPS_PIPE_DIRECTORY"]}
path = os.path.join(sys.argv[1], os.environ["RANK"] + ".json")
open(path + ".tmp", "w").write(json.dumps(report)); os.replace(path + ".tmp", path)
end = time.monotonic() + 60
while time.monotonic() < end:
    x = x * 1.0000001
    cupy.cuda.Device().synchronize()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_real_mps_server_ending_a_client_is_said_as_such(path, short_tmp, monkeypatch):
    """Two CuPy ranks on GPU 0 under MPS; the MPS server ends rank 1's client (terminate_client, from outside the
    job): the summary names rank 1 and CUDA_ERROR_MPS_CLIENT_TERMINATED, and says nothing of a signal, with Open MPI
    as with the local launcher."""
    pytest.importorskip("cupy")
    monkeypatch.delenv("CUDA_LOG_FILE", raising=False)
    job = subprocess.Popen(gpu_job_argv(path, [], [sys.executable, "-c", CUPY_BUSY, str(short_tmp)], ranks=2),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(short_tmp, 2, timeout=120, proc=job)
        victim = reports(short_tmp)[1]
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": victim["daemon"]}
        servers = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", capture_output=True,
                                 text=True, timeout=30, env=env).stdout.split()
        subprocess.run(["nvidia-cuda-mps-control"], input=f"terminate_client {servers[0]} {victim['pid']}\n",
                       capture_output=True, text=True, timeout=30, env=env, check=True)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
        job.wait()
    line = summary(subprocess.CompletedProcess([], job.returncode, out, err))
    assert job.returncode != 0 and "rank 1 (pid" in line, err
    assert "CUDA_ERROR_MPS_CLIENT_TERMINATED" in line and "the MPS server ended its CUDA client" in line, line
    assert "received" not in err, err


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_torchs_own_nccl_on_a_shared_gpu_is_named_with_the_remedy(path, monkeypatch):
    """Two ranks on GPU 0 all-reduce with the NCCL torch ships (2.28 with torch 2.11): NCCL refuses, and the summary
    names its version and how to get one that can (skipped where torch's own NCCL is 2.30 or newer)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.nccl.version()[:2] >= (2, 30):
        pytest.skip(f"torch's NCCL is {torch.cuda.nccl.version()}: it can share a GPU")
    for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    program = [sys.executable, str(Path(__file__).parents[1] / "examples" / "torch_allreduce.py"), "--iterations", "1"]
    out = subprocess.run(gpu_job_argv(path, [], program, ranks=2), capture_output=True, text=True, timeout=300)
    version = ".".join(map(str, torch.cuda.nccl.version()))
    assert out.returncode != 0 and f"NCCL {version} cannot put several ranks on one GPU" in summary(out), out.stderr


@pytest.mark.parametrize(("path", "error", "code"), [*[(path, "ValueError", 1) for path in PATHS],
                                                     ("local", "KeyboardInterrupt", 130)])
def test_a_python_ranks_traceback_holds_only_the_programs_frames(path, fake_gpu, tmp_path, error, code):
    """An uncaught exception in a Python rank shows the program's frames only (it carried 8 frames of mpi4py's
    runner and runpy; a KeyboardInterrupt still did), and the job's exit code is Python's (1, or 130: SIGINT)."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "boom.py"
    script.write_text(f"def fail():\n    raise {error}('boom')\n\n\nfail()\n")
    out = run_job(path, [], [sys.executable, str(script)], ranks=2)
    assert out.returncode == code, out.stderr
    frames = re.findall(r'File "([^"]+)"', out.stderr)
    assert frames and set(frames) == {str(script)}, out.stderr
    assert f"{error}: boom" in out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_a_missing_python_script_is_pythons_one_line(path, fake_gpu, tmp_path):
    """``mpsrun -np 2 python nosuchfile.py`` says what ``python nosuchfile.py`` says, at most once per rank, and exits
    2 (it printed two 12-line tracebacks of runpy and mpi4py and exited 1). The first rank's abort may end the other
    before its interpreter gets that far (seen under --hosts on a loaded machine): one line or two."""
    pytest.importorskip("mpi4py")
    out = run_job(path, [], [sys.executable, str(tmp_path / "nosuchfile.py")], ranks=2)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    said = [line for line in out.stderr.splitlines() if "can't open file" in line]
    assert 1 <= len(said) <= 2 and all(line.startswith(f"{sys.executable}: can't open file") for line in said), \
        out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_more_hardware_queues_than_a_gpu_has_is_said_with_the_way_out(path, fake_gpu, clean, monkeypatch):
    """16 ranks on one GPU that each ask 8 hardware queues (the caller's CUDA_DEVICE_MAX_CONNECTIONS) want 128 of the
    126 a GPU has under MPS, and one cannot create its context (on the H100: cudaErrorMemoryAllocation at
    cudaSetDevice, and mpsrun said only 'rank 14 exited with code 1 first'). The summary names the cause and the two
    ways out, on every path."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    out = run_job(path, ["--mps", "on"], fake("--hold", "30"), ranks=16)
    assert out.returncode == 1
    line = summary(out)
    assert "exited with code 1 first: 16 MPS clients on one GPU asked 8 hardware queues each " \
        "(CUDA_DEVICE_MAX_CONNECTIONS), 128 in all, more than the 126 a GPU has under MPS, so some could not create a " \
        "CUDA context: give mpsrun --queues auto to plan them, or --queues 7 or fewer" in line, line
    assert settle(fake_gpu)


@pytest.mark.parametrize("path", PATHS)
def test_the_queue_summary_never_advises_more_queues_than_mpsrun_takes(path, fake_gpu, clean, monkeypatch):
    """Two ranks whose caller's CUDA_DEVICE_MAX_CONNECTIONS is 64 ask 128 of the GPU's 126 queues and one fails: the
    summary's way out names --queues 32 or fewer, a count --queues takes (it said '--queues 63 or fewer', which
    mpsrun refuses: --queues takes 1 to 32), on every path."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "64")
    out = run_job(path, ["--mps", "on"], fake("--hold", "30"), ranks=2)
    assert out.returncode == 1
    line = summary(out)
    assert "2 MPS clients on one GPU asked 64 hardware queues each" in line, line
    assert line.endswith("give mpsrun --queues auto to plan them, or --queues 32 or fewer"), line
    assert settle(fake_gpu)


def test_hardware_queues_that_fit_start_every_rank(fake_gpu, clean, monkeypatch):
    """15 ranks asking 8 queues each (120 of the GPU's 126) all start, and so do 16 with --queues auto (7 each, over
    the caller's 8): the summary above is not said of a job whose queues fit."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert run_job("local", ["--mps", "on"], fake(), ranks=15).returncode == 0
    out = run_job("local", ["--mps", "on", "--queues", "auto"], fake(), ranks=16)
    assert out.returncode == 0, out.stderr
    assert settle(fake_gpu)


#: A CuPy rank that creates its context, runs one kernel, and keeps its context until every rank has one (in the
#: directory argv[1]): the queues are taken while a context lives.
CUPY_HOLDS_ITS_CONTEXT = """
import os, sys, time, cupy
cupy.ones(8).sum(); cupy.cuda.Device().synchronize()
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
end = time.monotonic() + 60
while len(os.listdir(sys.argv[1])) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < end:
    time.sleep(0.01)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_real_gpus_hardware_queues_run_out_as_the_summary_says(path, monkeypatch, tmp_path):
    """16 CuPy ranks on GPU 0 with CUDA_DEVICE_MAX_CONNECTIONS=8 that hold their contexts together ask 128 queues: on
    the H100 a context failed (cudaErrorMemoryAllocation at cudaSetDevice), and the summary names the queues and the
    way out; the same 16 ranks with --queues auto (7 each, over the caller's 8), and 15 with 8 (120), all run."""
    pytest.importorskip("cupy")

    def job(ranks: int, name: str, *options: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / name).mkdir()
        program = [sys.executable, "-c", CUPY_HOLDS_ITS_CONTEXT, str(tmp_path / name)]
        return subprocess.run(gpu_job_argv(path, list(options), program, ranks=ranks), capture_output=True,
                              text=True, timeout=300)

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    out = job(16, "over")
    assert out.returncode == 1 and "16 MPS clients on one GPU asked 8 hardware queues each" in summary(out), out.stderr
    assert job(15, "fits").returncode == 0
    out = job(16, "planned", "--queues", "auto")
    assert out.returncode == 0, out.stderr


def _mpsrun_said(out: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in out.stderr.splitlines() if line.startswith("mpsrun"))


@pytest.mark.parametrize("path", PATHS)
def test_a_device_ordinal_error_is_not_hidden_behind_a_queue_guess(path, fake_gpu, clean, monkeypatch):
    """16 ranks that use LOCAL_RANK as their CUDA device, with the caller's CUDA_DEVICE_MAX_CONNECTIONS=8 (16 x 8 is
    more than the GPU's 126): ranks 1-15 fail at 'invalid device ordinal', before any queue is asked for, and the
    summary names that cause and its way out, not the queues (a hostile user saw the queues blamed), on every path."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    out = run_job(path, ["--mps", "on"], fake("--device", "local", "--hold", "30"), ranks=16)
    said = _mpsrun_said(out)
    assert out.returncode == 1 and "(LOCAL_RANK as a device index)" in said and "hardware queues" not in said, said
    settle(fake_gpu)


def test_more_ranks_than_a_server_takes_are_not_told_to_set_zero_queues(fake_gpu, clean):
    """127 ranks on one GPU with the queues mpsrun plans (1 each): the server refuses the 49th client, and the summary
    does not blame the queues nor advise 'set at most 0' (it counts at most the 48 clients a server takes); the MPS
    log's line names the cause. Each client holds long enough for all to overlap on a loaded machine (the refusal
    then stops the others at once): with 20 s, under load, the first ones ended before the 49th came."""
    out = run_job("local", ["--mps", "on"], fake("--hold", "120"), ranks=127, timeout=300)
    said = _mpsrun_said(out)
    assert out.returncode != 0 and "maximum number of clients (48) reached" in said, said
    assert "set at most 0" not in said and "unset CUDA_DEVICE_MAX_CONNECTIONS" not in said, said
    settle(fake_gpu, 60)
