"""The fake daemon tells the truth: it replays what the real one printed on an H100."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAKECUDA, fake, gpu_job_argv, job_argv, reports, run_job, wait_ready
from replay import recorded_records, run_script, send

from mpsrun.mps import gpus
from mpsrun.mps.daemon import ControlDaemon, find_control_executable
from mpsrun.session.paths import SessionDirs


@pytest.fixture
def fake_daemon(fake_gpu):
    dirs = SessionDirs.create(fake_gpu.tmpdir, [0])
    daemon = ControlDaemon(devices=fake_gpu.uuids[0], pipe_dir=dirs.pipe_dir(0), log_dir=dirs.log_dir(0))
    daemon.start(timeout=10)
    yield daemon
    daemon.stop(timeout=5)
    dirs.remove()


def test_fake_replays_the_recorded_h100_session(fake_daemon, fake_gpu):
    """Every recorded command (but device tables) gets the same stdout, stderr and exit code from the fake."""
    meta, records = recorded_records()
    assert len(records) > 30
    server = None
    for record in records:
        command = record["cmd"].replace("\\n", "\n").replace(meta["uuid"], fake_gpu.uuids[0])
        if server is not None:
            command = command.replace(str(meta["server_pid"]), str(server))
        out, err, code = send(fake_daemon.executable, fake_daemon.pipe_dir, command)
        if command.startswith("start_server"):
            server = fake_daemon.server_list()[0]
        if server is not None:
            out = out.replace(str(server), str(meta["server_pid"]))
        assert (out.replace(fake_gpu.uuids[0], meta["uuid"]), err, code) == (
            record["stdout"], record["stderr"], record["rc"]), command


def test_fake_without_daemon_matches_the_real_message(fake_gpu, short_tmp):
    """With no daemon, the fake client prints the real message on stderr and exits 1."""
    assert send(find_control_executable(), short_tmp, "get_server_list") == (
        "", "Cannot find MPS control daemon process\n", 1)


@pytest.mark.gpu
def test_real_daemon_and_fake_answer_the_same_script(tmp_path):
    """GPU tier: the same command script gives the same replies from the real daemon and the fake."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    wrapper = fake_bin / "nvidia-cuda-mps-control"
    fake_dir = Path(__file__).resolve().parent / "fake_mps"
    wrapper.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(fake_dir)!r})\n"
                       "from fake_mps_control import main\nsys.exit(main(sys.argv[1:]))\n")
    wrapper.chmod(0o755)
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    results = {}
    for name, executable in (("real", find_control_executable()), ("fake", str(wrapper))):
        root = Path(os.path.realpath("/tmp")) / f"mr{name}{os.getpid()}"
        dirs = SessionDirs(root=root)
        for path in (dirs.pipe_dir(0), dirs.log_dir(0)):
            path.mkdir(parents=True, mode=0o700)
        daemon = ControlDaemon(devices=uuid, pipe_dir=dirs.pipe_dir(0), log_dir=dirs.log_dir(0),
                               executable=executable)
        try:
            daemon.start(timeout=30)
            results[name] = run_script(daemon.executable, daemon.pipe_dir)
        finally:
            daemon.stop(timeout=30)
            dirs.remove()
    for real, faked in zip(results["real"], results["fake"]):
        assert real == faked


def test_the_fake_takes_as_many_clients_at_once_as_the_real_server(fake_gpu):
    """48 ranks connecting at once all become clients, as on the real server (48 per server on Volta and later):
    the fake's socket had socketserver's backlog of 5, and every job of 41 or more fake CUDA ranks failed with
    CUDA_ERROR_MPS_RPC_FAILURE."""
    out = run_job("local", [], [sys.executable, str(FAKECUDA), "--hold", "1"], ranks=48, timeout=300)
    assert out.returncode == 0, out.stderr


#: What NVML listed on the H100 (driver 580) for MPS clients that held 0.5, 1, 1.5 and 2 GiB: MiB, their allocations
#: and their contexts.
HELD_MIB = [512, 1024, 1536, 2048]
LISTED_MIB = [1030, 1542, 2054, 2566]


def _listed(job: subprocess.Popen, directory: Path, uuid: str) -> tuple[dict[int, int], dict[int, int]]:
    """While the job runs: each rank's memory among NVML's MPS clients (MiB, by rank), and the memory of every other
    process in NVML's plain list (MiB, by pid)."""
    import pynvml

    try:
        wait_ready(directory, 4, timeout=120, proc=job)
        ranks = {report["pid"]: rank for rank, report in reports(directory).items()}
        memory = gpus.mps_client_memory(uuid)
        pynvml.nvmlInit()
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        others = {p.pid: (p.usedGpuMemory or 0) >> 20 for p in listed if p.pid not in ranks}
    finally:
        job.terminate()
        job.communicate(timeout=60)
    assert memory is not None
    return {ranks[pid]: used >> 20 for pid, used in memory.items() if pid in ranks}, others


def test_the_fake_lists_each_mps_clients_memory_as_the_h100_did(fake_gpu, short_tmp, monkeypatch):
    """Four fake ranks that hold 0.5, 1, 1.5 and 2 GiB are listed among NVML's MPS clients with 1030, 1542, 2054 and
    2566 MiB, as on the H100, and the MPS server in the plain list only, with 66 MiB; where NVML cannot list MPS
    clients (FAKE_NVML_NO_MPS_LIST), there is no list."""
    program = fake("--hold", "60", "--alloc", ",".join(map(str, HELD_MIB)), "--report-dir", str(short_tmp))
    job = subprocess.Popen(job_argv("local", [], program, ranks=4), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    memory, others = _listed(job, short_tmp, fake_gpu.uuids[0])
    assert memory == dict(enumerate(LISTED_MIB))
    assert list(others.values()) == [66], others  # the server
    monkeypatch.setenv("FAKE_NVML_NO_MPS_LIST", "1")
    assert gpus.mps_client_memory(fake_gpu.uuids[0]) is None


#: A CuPy rank that holds MiB of device memory (its item of argv[1]) and says where it is.
CUPY_HOLDS = """
import json, os, sys, time, cupy
held = cupy.zeros(int(sys.argv[1].split(",")[int(os.environ["RANK"])]) << 20, dtype=cupy.uint8)
cupy.cuda.Device().synchronize()
path = os.path.join(sys.argv[2], os.environ["RANK"] + ".json")
open(path + ".tmp", "w").write(json.dumps({"pid": os.getpid()})); os.replace(path + ".tmp", path)
time.sleep(60)
"""


@pytest.mark.gpu
def test_the_real_nvml_lists_each_mps_clients_memory_as_the_fake_does(short_tmp):
    """Four CuPy ranks on GPU 0 hold 0.5, 1, 1.5 and 2 GiB: NVML lists each among the MPS clients within 10% of what
    the fake lists for such a rank (its allocation and a context)."""
    pytest.importorskip("cupy")
    program = [sys.executable, "-c", CUPY_HOLDS, ",".join(map(str, HELD_MIB)), str(short_tmp)]
    job = subprocess.Popen(gpu_job_argv("local", [], program, ranks=4), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    uuid = gpus.visible_gpus()[0].uuid
    memory, _ = _listed(job, short_tmp, uuid)
    assert sorted(memory) == [0, 1, 2, 3] and all(abs(memory[rank] - LISTED_MIB[rank]) <= LISTED_MIB[rank] / 10
                                                  for rank in memory), memory
