"""Calls the tests of mpsrun.Executor send to its workers (a small module: each spawned worker imports it)."""

import os
import signal
import sys
import time
from pathlib import Path


def placed(x):
    """x squared, with what the worker's environment says of its GPU and MPS limits."""
    return x * x, os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), \
        os.environ.get("CUDA_VISIBLE_DEVICES")


def fails(x):
    raise ValueError(f"call {x} failed here")


class TwoArgumentError(Exception):
    """An exception whose __init__ takes other arguments than its args: its pickle does not make it again."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def fails_unrebuildably(x):
    raise TwoArgumentError(f"call {x} failed here", 2)


def dies(x):
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(seconds):
    time.sleep(seconds)
    return os.getpid()


def cuda_client(fake_mps, hold=0.0):
    """Become a client of the worker's (fake) MPS server, as a CUDA program's first call does, and hold ``hold``
    seconds; the worker's pid."""
    _context(fake_mps)
    time.sleep(hold)
    return os.getpid()


def waits_for(path):
    """Wait until ``path`` exists (at most a minute)."""
    end = time.monotonic() + 60
    while not Path(path).exists() and time.monotonic() < end:
        time.sleep(0.02)
    return True


def cupy_sum(x):
    """A small CuPy reduction on the worker's GPU: x times 65,536."""
    import cupy

    return float((cupy.ones(1 << 16, dtype=cupy.float32) * x).sum())


_CONTEXT = []  # this worker's (fake) CUDA context, made by its first call that needs one


def _context(fake_mps):
    if not _CONTEXT:
        sys.path.insert(0, fake_mps)
        from fakecuda import init

        _CONTEXT.append(init())
    return _CONTEXT[0]


def _wait_for_others(marks, others):
    """Until ``others`` calls of other workers have left their marks (each holds a context then; at most a minute)."""
    end = time.monotonic() + 60
    while len([m for m in marks.glob("ran.*") if not m.name.startswith(f"ran.{os.getpid()}.")]) < others \
            and time.monotonic() < end:
        time.sleep(0.02)


def kernels_until_fault(fake_mps, marks, fault, others, again=None):
    """As a CUDA task: kernels on the worker's (fake) MPS client. ``fault``: once ``others`` other calls hold a
    context (their marks), make a fatal fault (as an illegal address does). The others run kernels until the fault
    tears them down; run again after it (alone), they run briefly, or exit with ``again`` where given. A CUDA error is
    raised as CuPy raises it (an exception), not as the fake's SystemExit."""
    marks = Path(marks)
    rerun = (marks / "faulted").exists()  # looked at before this call's mark: a run after the fault
    if rerun and again is not None:
        raise SystemExit(again)
    context = _context(fake_mps)
    (marks / f"ran.{os.getpid()}.{time.monotonic_ns()}").touch()
    try:
        if fault:
            _wait_for_others(marks, others)
            (marks / "faulted").touch()
            context.fault()
        end = time.monotonic() + (0.2 if rerun else 60)
        while time.monotonic() < end:
            context.kernel()
            time.sleep(0.02)
    except SystemExit as exc:
        raise RuntimeError(f"CUDA error: {exc.code}") from None
    return os.getpid()


def cupy_until_fault(marks, fault, others):
    """As kernels_until_fault, on a real GPU with CuPy: ``fault`` makes an illegal address once ``others`` other calls
    hold a context; the others run kernels until it was made."""
    import cupy

    marks = Path(marks)
    x = cupy.ones(1 << 16, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    (marks / f"ran.{os.getpid()}.{time.monotonic_ns()}").touch()
    if fault:
        _wait_for_others(marks, others)
        (marks / "faulted").touch()
        bad = cupy.RawKernel(r'extern "C" __global__ void bad(int* p) { p[threadIdx.x] = 1; }', "bad")
        bad((1,), (32,), (cupy.int64(16),))
        cupy.cuda.Device().synchronize()
    end = time.monotonic() + (0.2 if (marks / "faulted").exists() else 60)
    while time.monotonic() < end:
        x = x * 1.0000001
        cupy.cuda.Device().synchronize()
    return os.getpid()


def nested(x):
    """An Executor inside a worker."""
    import mpsrun

    with mpsrun.Executor(workers=1) as inner:
        return inner.submit(placed, x).result()


def leaves_a_process(seconds):
    """Start a process and return its pid without waiting for it."""
    import subprocess

    return subprocess.Popen(["sleep", str(seconds)]).pid


def marks_then_sleeps(marks, seconds):
    """Mark this worker's pid in ``marks``, then sleep."""
    Path(marks, str(os.getpid())).touch()
    time.sleep(seconds)
    return os.getpid()


def forks_then_dies(marks, seconds):
    """Fork a child that lives ``seconds`` (holding the worker's descriptors; its pid marked in ``marks``), then
    end the worker."""
    if os.fork() == 0:
        Path(marks, str(os.getpid())).touch()
        time.sleep(seconds)
        os._exit(0)
    time.sleep(0.2)
    os._exit(1)
