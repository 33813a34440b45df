"""Integration tests: ControlDaemon against the fake nvidia-cuda-mps-control."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from mpsrun.errors import DaemonError, DaemonStartError, DaemonTimeoutError
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.replies import ServerStatus
from mpsrun.session.paths import SessionDirs


@pytest.fixture
def daemon(fake_gpu):
    dirs = SessionDirs.create(fake_gpu.tmpdir, [0])
    d = ControlDaemon(devices=fake_gpu.uuids[0], pipe_dir=dirs.pipe_dir(0), log_dir=dirs.log_dir(0))
    yield d
    d.stop(timeout=5)
    dirs.remove()


def test_start_configure_serve_and_stop(daemon, fake_gpu):
    """The daemon answers, takes defaults, starts an ACTIVE server, and stop() leaves no process."""
    daemon.start(timeout=10)
    assert daemon.alive and daemon.server_list() == []
    daemon.set_defaults(thread_percentage=40, mem_limit=2048)
    assert daemon.command("get_default_active_thread_percentage") == "40.0"
    assert daemon.command("get_default_device_pinned_mem_limit 0") == "2G"
    server = daemon.start_server(timeout=10)
    assert daemon.server_list() == [server]
    assert daemon.server_status(server) is ServerStatus.ACTIVE
    assert daemon.command(f"get_active_thread_percentage {server}") == "40.0"
    assert "control.log" in os.listdir(daemon.log_dir) and daemon.log_tail()
    pids = [daemon.pid, server]
    daemon.stop(timeout=5)
    assert not daemon.alive
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_failed_commands_raise_with_command_and_reply(daemon, monkeypatch):
    """The client exits 0 on failed commands, so replies are parsed: errors carry command and reply."""
    daemon.start(timeout=10)
    with pytest.raises(DaemonError) as info:
        daemon.command("frobnicate")
    assert info.value.command == "frobnicate" and info.value.reply == 'Unknown command "frobnicate"'
    with pytest.raises(DaemonError, match="not found"):
        daemon.server_status(999999)
    with pytest.raises(DaemonError, match="did not take 'set_default_active_thread_percentage 0'"):
        daemon.set_defaults(thread_percentage=0)  # the daemon answers with the unchanged value
    daemon.set_defaults(mem_limit=1536)  # stored as 1G, as the real daemon does: taken
    asked = ControlDaemon.command

    def stored_otherwise(self, text, timeout=None):  # a daemon that stored something else (the real one keeps an
        return "12M" if text.startswith("get_default_device") else asked(self, text, timeout)  # "12Q" as 12M)

    monkeypatch.setattr(ControlDaemon, "command", stored_otherwise)
    with pytest.raises(DaemonError, match="it stored '12M'"):
        daemon.set_defaults(mem_limit=2048)


def test_command_without_daemon_raises(daemon):
    """Before start (no daemon in the pipe directory) a command fails with the tool's own message."""
    daemon.executable = "nvidia-cuda-mps-control"
    with pytest.raises(DaemonError, match="Cannot find MPS control daemon process"):
        daemon.command("get_server_list")


def test_server_initializing_is_polled_until_active(daemon, fake_gpu):
    """A server that reports INITIALIZING first is polled (not slept on) until ACTIVE."""
    fake_gpu.daemon_env(FAKE_MPS_INIT_POLLS="3")
    daemon.start(timeout=10)
    server = daemon.start_server(timeout=10)
    assert daemon.server_status(server) is ServerStatus.ACTIVE


def test_daemon_that_exits_at_start_reports_log_tail(daemon, fake_gpu):
    """A daemon that dies at start gives DaemonStartError with its exit code and last log line."""
    fake_gpu.daemon_env(FAKE_MPS_START_FAIL="1")
    with pytest.raises(DaemonStartError, match="exited with code 1.*already running") as info:
        daemon.start(timeout=10)
    assert "already running" in info.value.log_tail
    assert not daemon.alive


def test_daemon_that_never_answers_times_out_and_is_killed(daemon, fake_gpu):
    """A daemon that never opens its socket hits the deadline; it is then killed by its pid group."""
    fake_gpu.daemon_env(FAKE_MPS_NO_ANSWER="1")
    start = time.monotonic()
    with pytest.raises(DaemonTimeoutError, match="did not answer within 0.5 s"):
        daemon.start(timeout=0.5)
    assert time.monotonic() - start < 6
    assert not daemon.alive


def test_clients_terminate_and_quit_blocking(daemon, fake_gpu):
    """Clients are listed; terminate_client ends one at its next call; quit waits for live ones."""
    daemon.start(timeout=10)
    server = daemon.start_server(timeout=10)
    env = {**os.environ, **{"CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir)}}
    done = daemon.pipe_dir.parent / "second-done"
    first = subprocess.Popen(fake_gpu.client_command("--hold", "30"), env=env, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(fake_gpu.client_command("--until-file", str(done)), env=env)
    deadline = time.monotonic() + 10
    while daemon.clients() != {first.pid, second.pid} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert daemon.clients() == {first.pid, second.pid}
    daemon.terminate_client(server, first.pid)
    assert first.wait(timeout=10) == 1
    assert "cudaErrorMpsClientTerminated" in first.stderr.read()
    first.stderr.close()
    started = time.monotonic()
    threading.Timer(0.5, done.touch).start()  # the second client's work ends 0.5 s into the quit
    daemon.stop(timeout=10)  # quit blocks until the second client is done
    assert second.poll() == 0
    assert time.monotonic() - started > 0.3


def test_stop_escalates_when_quit_hangs(daemon, fake_gpu):
    """When quit does not return by the deadline, the daemon's process group is killed."""
    fake_gpu.daemon_env(FAKE_MPS_QUIT_HANG="1")
    daemon.start(timeout=10)
    server = daemon.start_server(timeout=10)
    started = time.monotonic()
    daemon.stop(timeout=1, grace=0.5)
    assert time.monotonic() - started < 5
    assert not daemon.alive
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE


def test_daemon_dies_with_its_parent(fake_gpu, short_tmp):
    """The parent-death signal: if the process that started the daemon is SIGKILLed, the daemon dies too."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from mpsrun.mps.daemon import ControlDaemon\n"
        f"d = ControlDaemon(devices='GPU-x', pipe_dir=Path({str(short_tmp)!r}), log_dir=Path({str(short_tmp)!r}))\n"
        "d.start(timeout=10)\n"
        "print(d.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    daemon_pid = int(holder.stdout.readline())
    holder.stdout.close()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    gone = psutil.wait_procs([psutil.Process(daemon_pid)], timeout=5)[0]
    assert [p.pid for p in gone] == [daemon_pid]
