"""Integration tests: mps_session() against the fake daemon and fake NVML."""

import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import FAKECUDA, wait_for

from mpsrun import (
    ConfigError,
    DaemonStartError,
    GPUNotFoundError,
    MPSError,
    MPSUnavailableError,
    NotMPSClientError,
    TeardownError,
    mps_session,
)
from mpsrun.mps.daemon import ControlDaemon


def run_client(fake_gpu, tmp, *args, env=None):
    """Run the fake CUDA program to completion and return what it reported."""
    report = Path(tmp) / f"report{len(list(Path(tmp).glob('report*')))}.json"
    subprocess.run(fake_gpu.client_command("--report", str(report), *args), env=env, check=True, timeout=30)
    return json.loads(report.read_text())


def test_session_starts_active_and_leaves_nothing(fake_gpu):
    """A session starts one daemon with an ACTIVE server; afterwards no process or directory is left."""
    with mps_session(gpu=0) as session:
        status = session.status()
        assert status["enabled"] and len(status["gpus"]) == 1
        entry = status["gpus"][0]
        assert entry["uuid"] == fake_gpu.uuids[0] and entry["daemon_alive"]
        assert list(entry["servers"].values()) == ["ACTIVE"]
        root = Path(status["directory"])
        assert (root.stat().st_mode & 0o777) == 0o700
        assert json.loads((root / "session.json").read_text())["owner"]["pid"] == os.getpid()
        pids = [entry["daemon_pid"], *entry["servers"]]
    assert not root.exists()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_env_and_export(fake_gpu, short_tmp, monkeypatch):
    """env() names our GPU and daemon and the limits; export sets them for children and restores after."""
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "77")
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    with mps_session(gpu=0, thread_percentage=50, mem_limit="4G") as session:
        env = session.env()
        assert env["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0]
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"
        assert "CUDA_MPS_CLIENT_PRIORITY" not in env
        for name, value in env.items():
            assert os.environ[name] == value
        assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ  # a stale setting does not leak
        child = run_client(fake_gpu, short_tmp)  # inherits os.environ
        assert child["mps"] and child["uuid"] == fake_gpu.uuids[0]
        assert child["env"]["CUDA_MPS_PIPE_DIRECTORY"] == env["CUDA_MPS_PIPE_DIRECTORY"]
        daemon = session.daemons[0]
        server = daemon.server_list()[0]
        assert daemon.command(f"get_active_thread_percentage {server}") == "50.0"
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "77"
    assert os.environ["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def _spawned_worker(seconds):
    """Runs in a multiprocessing (spawn) worker: become a fake CUDA client and work."""
    sys.path.insert(0, str(FAKECUDA.parent))
    import fakecuda

    ctx = fakecuda.init()
    ctx.kernel()
    return os.getpid(), ctx.mps


def test_start_without_waiting_then_wait_active(fake_gpu):
    """start(wait_active=False) returns with daemons answering; wait_active() then sees ACTIVE servers."""
    fake_gpu.daemon_env(FAKE_MPS_INIT_POLLS="2")
    session = mps_session(gpu=0).start(wait_active=False)
    try:
        session.wait_active()
        assert list(session.status()["gpus"][0]["servers"].values()) == ["ACTIVE"]
    finally:
        session.close()


def test_multiprocessing_spawn_workers_are_verified_clients(fake_gpu):
    """Spawned pool workers inherit the exported session and verify() confirms each is our client."""
    with mps_session(gpu=0) as session:
        pool = multiprocessing.get_context("spawn").Pool(4)
        try:
            results = pool.map(_spawned_worker, [0.1] * 4)
            worker_pids = [p.pid for p in pool._pool]
            assert all(mps for _, mps in results)
            assert set(session.verify(worker_pids)) == {pid for pid, _ in results}
            assert {pid for pid, _ in results} <= session.clients()
        finally:
            pool.terminate()
            pool.join()


def test_verify_catches_a_process_that_missed_the_daemon(fake_gpu, short_tmp):
    """A worker whose pipe directory points elsewhere silently runs without MPS; verify() names it."""
    with mps_session(gpu=0) as session:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(short_tmp)}
        stray = subprocess.Popen(fake_gpu.client_command("--hold", "30"), env=env)
        good = subprocess.Popen(fake_gpu.client_command("--hold", "30"))
        try:
            wait_for(lambda: Path(os.environ["MPSRUN_FAKE_NVML"], "procs", str(stray.pid)).exists())
            wait_for(lambda: good.pid in session.clients())
            with pytest.raises(NotMPSClientError) as info:
                session.verify()
            assert info.value.pids == [stray.pid]
            assert info.value.gpu == fake_gpu.uuids[0]
            assert session.verify([good.pid]) == [good.pid]
        finally:
            for proc in (stray, good):
                proc.kill()
                proc.wait()


def test_body_exception_propagates_unchanged_and_teardown_runs(fake_gpu):
    """The with-body's exception reaches the caller unchanged; daemons and directories are still removed."""

    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info, mps_session(gpu=0) as session:
        root = session.dirs.root
        raise Boom("body failed")
    assert str(info.value) == "body failed"
    assert not root.exists() and not session.daemons[0].alive


def _break_daemon_stop(monkeypatch):
    """Make ControlDaemon.stop do its job and then report a failure."""
    original = ControlDaemon.stop

    def broken_stop(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise OSError("cannot stop")

    monkeypatch.setattr(ControlDaemon, "stop", broken_stop)


def test_teardown_failure_is_attached_not_substituted(fake_gpu, monkeypatch):
    """If teardown fails while the body raised, the body's error propagates with a note about teardown."""
    _break_daemon_stop(monkeypatch)
    with pytest.raises(KeyError) as info, mps_session(gpu=0):
        raise KeyError("body")
    assert any("teardown failed: cannot stop" in note for note in getattr(info.value, "__notes__", []))


def test_teardown_failure_without_body_error_raises(fake_gpu, monkeypatch):
    """A teardown failure after a clean body raises TeardownError carrying the cause."""
    _break_daemon_stop(monkeypatch)
    with pytest.raises(TeardownError) as info, mps_session(gpu=0):
        pass
    assert isinstance(info.value.errors[0], OSError)


def test_clients_alive_at_exit_are_stopped_after_the_deadline(fake_gpu):
    """A client still running at exit makes quit block; after stop_timeout the daemon is killed."""
    with mps_session(gpu=0, stop_timeout=1) as session:
        straggler = subprocess.Popen(fake_gpu.client_command("--hold", "60"))
        wait_for(lambda: straggler.pid in session.clients())
    # The daemon was killed under the client; its next call fails (as cudaErrorMpsRpcFailure would).
    assert straggler.wait(timeout=10) == 1


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_two_gpus_get_a_daemon_each(fake_gpu):
    """gpus=[0, 1] starts one daemon per GPU; env(rank) alternates; env() without rank is refused."""
    with mps_session(gpus=[0, 1]) as session:
        assert [d.devices for d in session.daemons] == fake_gpu.uuids
        assert session.env(0)["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[0]
        assert session.env(3)["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[1]
        assert session.env(0)["CUDA_MPS_PIPE_DIRECTORY"] != session.env(1)["CUDA_MPS_PIPE_DIRECTORY"]
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # nothing exported with several GPUs
        with pytest.raises(ConfigError, match="pass rank="):
            session.env()
    with pytest.raises(ConfigError, match="export=True needs a single GPU"), mps_session(gpus="all", export=True):
        pass


def test_cuda_visible_devices_is_honoured(fake_gpu, monkeypatch):
    """gpu=0 means the first GPU the caller can see, as CUDA numbers them."""
    fake_gpu.gpus.append({**fake_gpu.gpus[0], "uuid": "GPU-second"})
    Path(os.environ["MPSRUN_FAKE_NVML"], "gpus.json").write_text(json.dumps(fake_gpu.gpus))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with mps_session(gpu=0) as session:
        assert session.gpus[0].uuid == "GPU-second"
        assert session.daemons[0].env["CUDA_VISIBLE_DEVICES"] == "GPU-second"


def test_unknown_gpu_is_refused_before_anything_starts(fake_gpu):
    """gpu=7 on a one-GPU machine raises GPUNotFoundError (a ValueError) listing what exists."""
    with pytest.raises(GPUNotFoundError, match="GPU 7 is not visible; visible GPUs: 0: Fake H100"):
        with mps_session(gpu=7):
            pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"thread_percentage": 0}, "thread_percentage must be a whole number from 1 to 100"),
        ({"thread_percentage": 101}, "thread_percentage"),
        ({"mem_limit": "12Q"}, "mem_limit must be a size"),
        ({"priority": 5}, "priority must be 0"),
        ({"mps": "maybe"}, "mps must be one of"),
        ({"gpu": 0, "gpus": [0]}, "not both"),
        ({"gpus": []}, "at least one GPU"),
        ({"tmpdir": "/" + "x" * 100}, "too long"),
        ({"stop_timeout": -1}, "stop_timeout must be more than 0 seconds"),
    ],
)
def test_bad_arguments_raise_value_errors_before_start(fake_gpu, kwargs, message):
    """Invalid arguments raise a ValueError-derived error at construction; nothing starts."""
    with pytest.raises(ValueError, match=message):
        mps_session(**kwargs)


def test_unwritable_tmpdir_is_refused(fake_gpu, short_tmp):
    """A tmpdir that does not exist is refused with advice to set MPSRUN_TMPDIR."""
    with pytest.raises(ConfigError, match="MPSRUN_TMPDIR"), mps_session(tmpdir=short_tmp / "missing"):
        pass


def test_daemon_start_failure_leaves_nothing(fake_gpu):
    """When the daemon cannot start, the error says why and the session directory is removed."""
    fake_gpu.daemon_env(FAKE_MPS_START_FAIL="1")
    with pytest.raises(DaemonStartError, match="exited with code 1"), mps_session(gpu=0):
        pass


def test_auto_without_driver_runs_disabled_and_says_why(no_gpu, caplog):
    """mps='auto' on a machine without a driver runs without MPS and logs the reason once."""
    with caplog.at_level(logging.WARNING, logger="mpsrun"), mps_session() as session:
        assert not session.enabled and session.env() == {}
        assert session.verify([os.getpid()]) == []
    assert [r.getMessage() for r in caplog.records] == [
        "mpsrun: running without MPS: no usable NVIDIA driver: NVML failed to initialise "
        "(NVML Shared Library Not Found)"
    ]


def test_on_without_driver_raises(no_gpu):
    """mps='on' on a machine without a driver raises MPSUnavailableError instead of falling back."""
    with pytest.raises(MPSUnavailableError, match="MPS is required"), mps_session(mps="on"):
        pass


def test_auto_without_control_program(fake_gpu, monkeypatch, caplog, short_tmp):
    """With a driver but no nvidia-cuda-mps-control, auto runs without MPS but still pins the GPU."""
    monkeypatch.setenv("PATH", str(short_tmp))
    with caplog.at_level(logging.WARNING, logger="mpsrun"), mps_session() as session:
        assert session.env() == {"CUDA_VISIBLE_DEVICES": fake_gpu.uuids[0]}
    assert "nvidia-cuda-mps-control is not on PATH" in caplog.text


def test_off_never_starts_a_daemon(fake_gpu):
    """mps='off' starts no daemon and makes no directory."""
    with mps_session(mps="off") as session:
        assert session.daemons == [] and session.dirs is None
        assert "CUDA_MPS_PIPE_DIRECTORY" not in session.env()


def test_keep_logs_keeps_the_directory(fake_gpu):
    """keep_logs=True leaves the session directory with the daemon's control.log."""
    with mps_session(keep_logs=True) as session:
        root = session.dirs.root
    assert (root / "gpu0" / "log" / "control.log").read_text()
    shutil.rmtree(root)


def test_session_cannot_restart_and_close_is_idempotent(fake_gpu):
    """A closed session cannot be started again; close() twice is harmless."""
    session = mps_session().start()
    session.close()
    session.close()
    with pytest.raises(Exception, match="closed"):
        session.start()


def test_a_session_started_in_a_thread_keeps_its_daemon(fake_gpu, short_tmp):
    """A session started in a worker thread that then ends keeps its daemon (the parent-death signal would follow
    that thread; the session's reaper covers the process instead): a later worker is an MPS client."""
    import threading

    holder = {}
    thread = threading.Thread(target=lambda: holder.setdefault("s", mps_session(gpu=0).start()))
    thread.start()
    thread.join()
    session = holder["s"]
    try:
        assert session.daemons[0].alive
        child = run_client(fake_gpu, short_tmp)
        assert child["mps"] is True
    finally:
        session.close()
    assert not session.daemons[0].alive and not session.dirs.root.exists()


def test_a_closed_session_cannot_be_entered_again(fake_gpu):
    """Entering a closed session raises (it used to be a silent no-op handing out deleted paths)."""
    session = mps_session()
    with session:
        pass
    with pytest.raises(MPSError, match="this session is closed"), session:
        pass


def test_nested_with_on_one_session_closes_at_the_outer_end(fake_gpu):
    """`with s: with s:`: the inner exit leaves the session running; the outer exit closes it."""
    session = mps_session()
    with session:
        with session:
            pass
        assert session.state == "running" and session.daemons[0].alive
    assert session.state == "closed"


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_gpu_indices_count_among_the_gpus_the_caller_sees(fake_gpu):
    """Inside an exporting session on GPU 1, the process sees one GPU: gpu=0 is that GPU (as CUDA numbers them),
    and gpu=1 is not visible."""
    with mps_session(gpu=1):
        with mps_session(gpu=0, export=False) as inner:
            assert inner.gpus[0].uuid == fake_gpu.uuids[1]
        with pytest.raises(GPUNotFoundError), mps_session(gpu=1, export=False):
            pass


def test_two_threads_cannot_both_export(fake_gpu):
    """A session exporting its variables while another thread's session does is refused (os.environ is shared)."""
    import threading

    errors = []
    with mps_session():
        def other():
            try:
                with mps_session():
                    pass
            except ConfigError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert errors and "another thread's session" in errors[0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": ""}, "at least one GPU"), ({"gpus": ","}, "at least one GPU"), ({"gpus": b"0"}, "GPU indices or GPU- UUIDs"),
    ({"keep_logs": "no"}, "keep_logs must be True or False"), ({"tmpdir": ""}, "tmpdir must name a directory"),
    ({"start_timeout": float("inf")}, "more than 0 seconds"), ({"export": 1}, "export must be True or False"),
])
def test_more_bad_arguments_are_refused(fake_gpu, kwargs, message):
    """Arguments that used to be guessed at (or crashed later) are refused when the session is made."""
    with pytest.raises(ConfigError, match=message):
        mps_session(**kwargs)


def test_gpus_all_in_any_case(fake_gpu):
    """gpus='ALL' means every visible GPU, as on the command line."""
    with mps_session(gpus="ALL") as session:
        assert [g.uuid for g in session.gpus] == fake_gpu.uuids


def test_a_signal_while_stale_sessions_are_removed_is_not_lost(fake_gpu, monkeypatch):
    """A SIGTERM that comes while a new session removes what killed earlier runs left (best effort: whatever fails
    there is passed over) stops the start-up. It was passed over with those failures, and every later signal of the
    start-up only noted: a node keeper whose rank had gone (it sends itself SIGTERM) started on, with its daemon, in
    1 of about 4 runs of test_a_rank_gone_as_soon_as_it_sent_its_keepers_request_leaves_nothing."""
    import signal
    import time

    from mpsrun.errors import InterruptionError
    from mpsrun.runtime.interrupts import Interrupts
    from mpsrun.session import registry
    from mpsrun.session.claim import SessionClaim
    from mpsrun.session.paths import make_user_root

    def signalled(*args: object, **kwargs: object) -> list[tuple[str, str]]:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the signal's exception comes first)
        return []

    monkeypatch.setattr(registry, "cleanup", signalled)
    (make_user_root(fake_gpu.tmpdir) / "left-by-an-earlier-run").mkdir()
    with pytest.raises(InterruptionError), Interrupts():
        SessionClaim.make(fake_gpu.tmpdir, "api")
    (make_user_root(fake_gpu.tmpdir) / "left-by-an-earlier-run").rmdir()
