"""Shared fixtures: the fake MPS daemon and fake NVML for CI, the GPU tier's gate, leak checks."""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import (
    FAKE_MPS,
    FAKE_NVML,
    FAKECUDA,
    GPU_BUSY,
    ROOT,
    TESTS,
    multiprocessing_helper,
    other_user_venv,
    real_gpu_available,
    tagged_processes,
)
from hypothesis import settings

# Hypothesis fails an example slower than 200 ms: on a loaded machine that is a timed test (a parser call took
# 315 ms once). Speed is measured by benchmarks, never by tests.
settings.register_profile("mpsrun", deadline=None)
settings.load_profile("mpsrun")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto`` (pyproject.toml's addopts). 8, also on 2 cores: most tests wait on the processes they
    start. None (in-process, one test at a time) where a real GPU answers: the GPU tier's tests share that GPU and
    measure it (its memory, its SMs), so two at once would disturb each other."""
    return 0 if real_gpu_available()[0] else 8


def pytest_configure(config: pytest.Config) -> None:
    # Started under nohup, or in the background by a shell without job control, we inherit SIGHUP or SIGINT
    # ignored, and so would every job a test starts (an ignored signal stays ignored across exec): the tests
    # that send them need them at their defaults.
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput"):
        return
    os.environ["MPSRUN_TEST_RUN"] = uuid.uuid4().hex[:12]  # the run's name, for what its xdist workers share
    # The suite starts thousands of Python processes (mpsrun, rank supervisors, node keepers, the fake daemon):
    # compiled once here, as Python itself would unless PYTHONDONTWRITEBYTECODE is set, they skip compiling
    # mpsrun's modules each time (a third of a small job's CPU time).
    for tree in (ROOT / "mpsrun", TESTS):
        compileall.compile_dir(tree, quiet=2, workers=1)


def _slow_first(items: list[pytest.Item], workers: int) -> None:
    """Tests marked slow (slow on purpose: what they prove takes time) go first, so xdist's workers run them
    alongside the many short ones instead of last, one by one: with several ``workers``, first in each worker's
    share (:func:`_dealt`)."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = _dealt(slow, rest, workers) if workers > 1 else slow + rest


def _dealt(slow: list[pytest.Item], rest: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The tests in the order that gives every worker its part of the slow ones first. Under worksteal each worker
    first gets its share of the list in one piece (later, idle ones steal from the end of a share): all the slow
    tests at the head of the list were the first worker's alone, one after another (336 s of a 349 s run; the other
    workers were done at 300 s)."""
    order: list[pytest.Item] = []
    for worker, share in enumerate(_first_shares(len(slow) + len(rest), workers)):
        mine = slow[worker::workers]
        filled = max(0, share - len(mine))
        order += mine + rest[:filled]
        del rest[:filled]
    return order + rest


def _first_shares(count: int, workers: int) -> list[int]:
    """How many tests each worker gets first under worksteal: the rest of the list split evenly, worker by worker
    (xdist's WorkStealingScheduling.check_schedule)."""
    shares = []
    for worker in range(workers):
        shares.append((count - sum(shares)) // (workers - worker))
    return shares


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_configure_node(node: Any) -> None:
    """Tells each xdist worker how the run deals out its tests (a worker's own option says none: xdist resets it)."""
    node.workerinput["mpsrun_dist"] = node.config.getoption("dist")


def _worksteal_workers(config: pytest.Config) -> int:
    """The number of xdist workers sharing the list under worksteal (1 in a run without them)."""
    workerinput = getattr(config, "workerinput", {})
    return workerinput["workercount"] if workerinput.get("mpsrun_dist") == "worksteal" else 1


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._mpsrun_began = time.time()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run leaves nothing in /tmp or /dev/shm: the second user's Python (tests/test_other_users.py); what MPICH left of
    the tests that run mpiexec or mpi4py bare, as mpsrun removes it after its own jobs (made since the run began, and
    held by no process: a concurrent run's are in use); and, when every test passed, pytest's own base directory
    (it keeps the last three; a failed run's stays, to look at). Under xdist the controller does it, once every
    worker is done."""
    if hasattr(session.config, "workerinput"):
        return
    shutil.rmtree(other_user_venv(), ignore_errors=True)  # made by the first test that needed a second user
    from mpsrun.session import leftovers

    leftovers.sweep(getattr(session.config, "_mpsrun_began", time.time()))
    factory = getattr(session.config, "_tmp_path_factory", None)  # pytest's; its directory, if a test made it
    base = getattr(factory, "_basetemp", None) if exitstatus == 0 else None
    if base is not None and base.parent.name.startswith("pytest-of-"):
        shutil.rmtree(base, ignore_errors=True)
        current = base.parent / "pytest-current"
        if current.is_symlink() and not current.exists():  # it named this run's directory
            current.unlink()
        with contextlib.suppress(OSError):  # only if nothing else is left in it
            base.parent.rmdir()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: the shares are of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_first(items, _worksteal_workers(config))
    if not config.pluginmanager.hasplugin("pytest_mpi"):
        for item in items:
            if item.get_closest_marker("mpi"):
                item.add_marker(pytest.mark.skip(reason="pytest-mpi is not installed"))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    ok, why = real_gpu_available()
    if ok:
        return
    if os.environ.get("MPSRUN_REQUIRE_GPU") == "1":
        config._mpsrun_gpu_missing = why  # type: ignore[attr-defined]  # fail them in setup
    else:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    why = getattr(item.config, "_mpsrun_gpu_missing", None)
    if why and item.get_closest_marker("gpu"):
        pytest.fail(f"MPSRUN_REQUIRE_GPU=1 but {why}", pytrace=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short private directory (socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _load_fake_pynvml() -> object:
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeGPU:
    """Handle on the fake machine: its GPUs, NVML directory and daemon switches."""

    def __init__(self, root: Path, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.nvml_dir = root / "nvml"
        self.nvml_dir.mkdir()
        self.gpus = [
            {"uuid": f"GPU-{i:08d}-fake-4000-8000-{i:012d}", "name": "Fake H100", "memory_total": 80 << 30}
            for i in range(count)
        ]
        (self.nvml_dir / "gpus.json").write_text(json.dumps(self.gpus))
        self.bin_dir = root / "bin"
        self.bin_dir.mkdir()
        wrapper = self.bin_dir / "nvidia-cuda-mps-control"
        wrapper.write_text(
            f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(FAKE_MPS)!r})\n"
            "from fake_mps_client import main\nsys.exit(main(sys.argv[1:]))\n"
        )
        wrapper.chmod(0o755)
        self.tmpdir = root / "t"
        self.tmpdir.mkdir(mode=0o700)

    @property
    def uuids(self) -> list[str]:
        return [g["uuid"] for g in self.gpus]

    def set_free_memory(self, free: int) -> None:
        """What NVML reports as free on every fake GPU from now on (bytes)."""
        for gpu in self.gpus:
            gpu["memory_free"] = free
        (self.nvml_dir / "gpus.json.tmp").write_text(json.dumps(self.gpus))
        (self.nvml_dir / "gpus.json.tmp").replace(self.nvml_dir / "gpus.json")  # NVML reads it while jobs run

    def daemon_env(self, **switches: str) -> None:
        """Set fault-injection switches (FAKE_MPS_*) for daemons started from now on."""
        for name, value in switches.items():
            self.monkeypatch.setenv(name, value)

    def client_command(self, *args: str) -> list[str]:
        return [sys.executable, str(FAKECUDA), *args]

    def orphans(self) -> list[psutil.Process]:
        """Live processes started under this fake machine that are no longer our descendants."""
        pids = _pids_whose_environment_has(f"MPSRUN_FAKE_NVML={self.nvml_dir}".encode())
        if not pids:
            return []
        mine = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        found = []
        for pid in pids - mine:
            with contextlib.suppress(psutil.NoSuchProcess):
                if _ours(proc := psutil.Process(pid)):
                    found.append(proc)
        return found

    def session_dirs(self) -> list[Path]:
        root = self.tmpdir / f"mpsrun-{os.getuid()}"
        return sorted(p for p in root.iterdir()) if root.is_dir() else []


def _pids_whose_environment_has(entry: bytes) -> set[int]:
    """The processes whose environment holds ``entry`` (``NAME=value``), read raw from /proc: tests and their
    fixtures look after every job, and psutil's process_iter(environ) costs about 15 times the CPU."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as stream:
                    data = stream.read()
            except OSError:  # gone, or not ours to read
                continue
            if data.startswith(entry + b"\0") or b"\0" + entry + b"\0" in data:
                found.add(int(name))
    return found


def _cmdline(proc: psutil.Process) -> list[str] | str:
    try:
        return proc.cmdline()
    except psutil.Error as exc:  # it ended as we looked
        return type(exc).__name__


def _ours(proc: psutil.Process) -> bool:
    """A live child started by a test (multiprocessing's own helper process lives on by design)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and not multiprocessing_helper(proc)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def fake_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    """A machine with fake GPUs (default 1; parametrize indirectly for more) and the fake daemon.

    Puts the fake ``nvidia-cuda-mps-control`` first on PATH, the fake ``pynvml`` in
    ``sys.modules`` and on PYTHONPATH, and a short MPSRUN_TMPDIR. Afterwards it checks
    that the test left no child process and no session directory behind.
    """
    count = getattr(request, "param", 1)
    root = Path(tempfile.mkdtemp(prefix="mf", dir="/tmp"))
    fake = FakeGPU(root, count, monkeypatch)
    monkeypatch.setenv("MPSRUN_FAKE_NVML", str(fake.nvml_dir))
    monkeypatch.setenv("PATH", f"{fake.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_NVML), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPSRUN_TMPDIR", str(fake.tmpdir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _load_fake_pynvml())
    try:
        yield fake
        leftovers = [p for p in psutil.Process().children(recursive=True) if _ours(p)] + fake.orphans()
        assert not leftovers, f"processes left behind: {[(p.pid, _cmdline(p)) for p in leftovers]}"
        assert not fake.session_dirs(), f"session directories left behind: {fake.session_dirs()}"
    finally:  # whatever a failed test left: our children, and detached processes of this fake machine
        for proc in [*psutil.Process().children(recursive=True), *fake.orphans()]:
            if _ours(proc):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch, short_tmp: Path) -> Path:
    """A machine with no NVIDIA driver and no MPS control program (also for child processes).

    PATH holds only an empty directory (tests start Python by absolute path), so a real
    nvidia-cuda-mps-control or mpiexec on a GPU machine stays out of sight.
    """
    monkeypatch.setenv("MPSRUN_FAKE_NVML", str(short_tmp / "absent"))
    monkeypatch.setitem(sys.modules, "pynvml", _load_fake_pynvml())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_NVML), os.environ.get("PYTHONPATH")])))
    empty_bin = short_tmp / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setenv("MPSRUN_TMPDIR", str(short_tmp))
    return short_tmp


@pytest.fixture
def cupy_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """GPU tier: a private MPSRUN_TMPDIR and a tag in every process's environment, and the CuPy rank
    (helpers.GPU_BUSY) as ``script``; afterwards nothing of the job is left."""
    tag = uuid.uuid4().hex
    base = Path(tempfile.mkdtemp(prefix="gc", dir="/tmp"))  # short: MPS socket paths are limited
    ready = tmp_path / "ready"
    ready.mkdir()
    for name, value in (("MPSRUN_TMPDIR", str(base)), ("MPSRUN_TEST_TAG", tag), ("READY_DIR", str(ready))):
        monkeypatch.setenv(name, value)
    script = tmp_path / "busy.py"
    script.write_text(GPU_BUSY)
    yield {"script": script, "ready": ready}
    deadline = time.monotonic() + 30
    while (left := tagged_processes(tag, base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
    root = base / f"mpsrun-{os.getuid()}"
    assert not root.exists() or list(root.iterdir()) == [], list(root.iterdir())
    shutil.rmtree(base, ignore_errors=True)
