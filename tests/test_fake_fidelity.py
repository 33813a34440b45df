"""The fake daemon tells the truth: it replays what the real one printed on an H100."""

import os
import sys
from pathlib import Path

import pytest
from helpers import FAKECUDA, run_job
from replay import recorded_records, run_script, send

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
    for real, fake in zip(results["real"], results["fake"]):
        assert real == fake


def test_the_fake_takes_as_many_clients_at_once_as_the_real_server(fake_gpu):
    """48 ranks connecting at once all become clients, as on the real server (48 per server on Volta and later):
    the fake's socket had socketserver's backlog of 5, and every job of 41 or more fake CUDA ranks failed with
    CUDA_ERROR_MPS_RPC_FAILURE."""
    out = run_job("local", [], [sys.executable, str(FAKECUDA), "--hold", "1"], ranks=48, timeout=300)
    assert out.returncode == 0, out.stderr
