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


def dies(x):
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(seconds):
    time.sleep(seconds)
    return os.getpid()


def cuda_client(fake_mps):
    """Become a client of the worker's (fake) MPS server, as a CUDA program's first call does; the worker's pid."""
    sys.path.insert(0, fake_mps)
    from fakecuda import init

    init()
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
