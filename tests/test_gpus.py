"""Unit tests: CUDA_VISIBLE_DEVICES handling and GPU selection (pure), and the NVML seam on the fake."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from mpsrun.config.values import parse_gpus
from mpsrun.errors import ConfigError, GPUNotFoundError, NoDriverError
from mpsrun.mps import gpus
from mpsrun.mps.gpus import GPU, parse_visible_devices, select_gpus

PHYSICAL = [GPU(i, f"GPU-{i}{i}aa-0000", "H100", 80 << 30, "Default", False) for i in range(4)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        ("1,7,2", [1]),  # CUDA stops at the first entry that names no device
        ("", []),
        ("-1", []),
        ("GPU-33", [3]),  # UUID prefixes are accepted, as by CUDA
        ("GPU-00aa-0000,1", [0, 1]),
        ("1,1", [1]),
    ],
)
def test_visible_devices_follow_cuda_rules(value, expected):
    """Indices, UUID prefixes, invalid entries and duplicates behave as CUDA treats them."""
    assert [g.index for g in parse_visible_devices(value, PHYSICAL)] == expected


def test_visible_devices_reject_mig():
    """A MIG instance in CUDA_VISIBLE_DEVICES is refused with a clear message."""
    with pytest.raises(ConfigError, match="MIG"):
        parse_visible_devices("MIG-abc", PHYSICAL)


def test_select_by_position_and_uuid():
    """GPUs are chosen by position among the visible ones (as CUDA numbers them) or by UUID, from the one parser's
    list (parse_gpus: the command line's and mps_session()'s alike)."""
    visible = [PHYSICAL[2], PHYSICAL[3]]
    assert select_gpus(parse_gpus([0]), visible) == [PHYSICAL[2]]
    assert select_gpus(parse_gpus(["1"]), visible) == [PHYSICAL[3]]
    assert select_gpus(parse_gpus("GPU-22"), visible) == [PHYSICAL[2]]
    assert select_gpus(parse_gpus("all"), visible) == visible


@pytest.mark.parametrize("request_", [[2], [-1], ["GPU-00"], ["abc"], [0, 0], [1.5], [True]])
def test_select_rejects_unknown_or_bad(request_):
    """An index out of range, an invisible UUID, junk or a repeat raises a ValueError naming the problem."""
    with pytest.raises(ValueError) as info:
        select_gpus(parse_gpus(request_), [PHYSICAL[2], PHYSICAL[3]])
    if isinstance(info.value, GPUNotFoundError):
        assert "visible GPUs: 0: H100 GPU-22aa-0000; 1: H100 GPU-33aa-0000" in str(info.value)


def test_select_with_nothing_visible():
    """Selecting from no visible GPUs says to check CUDA_VISIBLE_DEVICES."""
    with pytest.raises(GPUNotFoundError, match="CUDA_VISIBLE_DEVICES"):
        select_gpus(None, [])


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_nvml_seam_on_fake_driver(fake_gpu, monkeypatch):
    """list_gpus/visible_gpus/driver_info read NVML; CUDA_VISIBLE_DEVICES filters and orders."""
    listed = gpus.list_gpus()
    assert [g.uuid for g in listed] == fake_gpu.uuids
    assert listed[0].compute_mode == "Default" and listed[0].mig_enabled is False
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in gpus.visible_gpus()] == [1]
    assert gpus.driver_info().cuda_version == "13.0"
    assert gpus.compute_processes(fake_gpu.uuids[0]) == {}


def test_the_command_keeps_nvml_to_its_end_and_a_session_does_not(fake_gpu, short_tmp, monkeypatch):
    """The mpsrun command never shuts NVML down (its process ends right after the job, and the shutdown would only
    delay that); a session opened from Python code does, at its end."""
    from mpsrun import mps_session

    log = short_tmp / "shutdowns"
    monkeypatch.setenv("FAKE_NVML_SHUTDOWN_LOG", str(log))
    job = subprocess.run([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "true"],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert not log.exists() or log.read_text() == ""
    with mps_session(gpu=0):
        gpus.list_gpus()
    assert set(log.read_text().split()) == {str(os.getpid())}


def test_no_driver_is_a_clear_error(no_gpu):
    """Without a driver NVML fails to initialise and mpsrun raises NoDriverError saying so."""
    with pytest.raises(NoDriverError, match="no usable NVIDIA driver"):
        gpus.list_gpus()


def test_a_short_job_never_initialises_nvml_in_the_launcher(fake_gpu, short_tmp, monkeypatch):
    """A job that ends before the first client look initialises NVML once in all: for its GPU list, kept for the
    job (nvml_kept), never again for the client watch."""
    log = short_tmp / "inits"
    monkeypatch.setenv("FAKE_NVML_INIT_LOG", str(log))
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "true"],
                           stderr=subprocess.PIPE, text=True)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    inits = log.read_text().split()
    assert len(inits) == 1, inits
    assert inits != [str(job.pid)]  # read by a child: NVML not loaded in the job's own process before its forks


READ_AHEAD = """
import json, os, signal, sys, threading, time
from mpsrun.mps import gpus
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
if sys.argv[1] == "nofork":
    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    real_fork, os.fork = os.fork, refused
if sys.argv[1] == "interrupt":
    real_query = gpus._query
    gpus._query = lambda: (time.sleep(30), real_query())[1]  # the child's reading hangs
gpus.read_ahead()
ahead = gpus._read_ahead
if sys.argv[1] == "nofork":
    os.fork = real_fork
if sys.argv[1] == "interrupt":
    def interrupt(number, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        gpus.list_gpus()
    except KeyboardInterrupt:
        pass
    print(json.dumps({"forked": ahead is not None, "child_left": os.path.exists(f"/proc/{ahead.pid}")}))
    sys.exit()
if sys.argv[1] == "drop":
    gpus.drop_read_ahead()
    print(json.dumps({"forked": ahead is not None, "child_left": os.path.exists(f"/proc/{ahead.pid}")}))
    sys.exit()
try:
    listed = [gpu.uuid for gpu in gpus.list_gpus()]
except Exception as exc:
    listed = f"{type(exc).__name__}: {exc}"
print(json.dumps({"forked": ahead is not None, "listed": listed, "direct": [gpu.uuid for gpu in gpus._query()]
                  if sys.argv[1] != "nodriver" else None}))
"""


def _read_ahead(mode):
    out = subprocess.run([sys.executable, "-c", READ_AHEAD, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_the_gpu_list_read_ahead_by_a_child_is_the_drivers(fake_gpu):
    """read_ahead() forks a child that reads the GPU list; list_gpus() then gives what NVML gives when asked here."""
    result = _read_ahead("plain")
    assert result["forked"] and result["listed"] == result["direct"] == fake_gpu.uuids


def test_a_failed_reading_ahead_says_what_nvml_says(no_gpu):
    """A child that could not read the list leaves the question to list_gpus(), which raises NVML's own error."""
    result = _read_ahead("nodriver")
    assert result["forked"] and result["listed"].startswith("NoDriverError: no usable NVIDIA driver")


def test_no_reading_ahead_in_a_process_with_threads(fake_gpu):
    """With another thread alive nothing is forked (a fork copies no thread, nor a lock it holds); the list is
    read when asked for."""
    result = _read_ahead("thread")
    assert not result["forked"] and result["listed"] == result["direct"] == fake_gpu.uuids


def test_a_machine_that_cannot_fork_now_reads_the_list_when_asked(fake_gpu):
    """A fork refused (no process to spare, ``ulimit -u``) starts no reading, and list_gpus() asks NVML itself."""
    result = _read_ahead("nofork")
    assert not result["forked"] and result["listed"] == result["direct"] == fake_gpu.uuids


def test_a_wait_for_the_reading_cut_short_ends_the_child(fake_gpu):
    """A signal that ends the wait for the child's answer (Ctrl-C as the job plans) ends and reaps the child too."""
    result = _read_ahead("interrupt")
    assert result == {"forked": True, "child_left": False}


def test_a_reading_nobody_took_is_ended(fake_gpu):
    """drop_read_ahead() ends and reaps the child of a reading nobody took (a job that failed before planning)."""
    result = _read_ahead("drop")
    assert result == {"forked": True, "child_left": False}


def test_a_job_killed_outright_takes_its_gpu_reading_along(fake_gpu, monkeypatch):
    """mpsrun SIGKILLed while its child still reads the GPU list (a slow driver): the child ends with it, and
    whoever reads the job's output (``mpsrun ... | cat``) sees its end at once, not when NVML answers."""
    import select
    import time

    import psutil

    monkeypatch.setenv("FAKE_NVML_INIT_WAIT", "20")
    job = subprocess.Popen([sys.executable, "-m", "mpsrun", "-np", "2", "--launcher", "local", "true"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    reader = None
    while reader is None and time.monotonic() < deadline:  # the child: a fork, with the job's command line
        with contextlib.suppress(psutil.Error):
            me = psutil.Process(job.pid)
            reader = next((c for c in me.children() if c.cmdline() == me.cmdline()), None)
        time.sleep(0.01)
    assert reader is not None, "no GPU-list child appeared"
    job.kill()
    job.wait()
    waiting, deadline = [job.stdout, job.stderr], time.monotonic() + 5
    while waiting and time.monotonic() < deadline:  # select answers at the first stream that ends: each is awaited
        ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
        waiting = [stream for stream in waiting if stream not in ready]
    assert not waiting and job.stdout.read() == b"", "the job's output stayed open"
    assert psutil.wait_procs([reader], timeout=5)[1] == [], "the GPU-list child outlived the job"
    job.stdout.close()
    job.stderr.close()
