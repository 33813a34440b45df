"""What the test modules share: paths, the job command lines of every path, and waits on observed conditions.

Test modules import from here (and take fixtures from conftest.py); no test module imports another
(tests/test_helpers.py checks). Every wait here polls a condition against a deadline: none sleeps a fixed
time for something it could observe.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAKE_MPS = TESTS / "fake_mps"
FAKE_NVML = TESTS / "fake_nvml"
FAKE_CUDA = TESTS / "fake_cuda"
FAKECUDA = FAKE_MPS / "fakecuda.py"
PROGRAMS = TESTS / "programs"

#: The four ways of starting a job's ranks (tests/test_contract.py): the local launcher, the mpiexec launcher,
#: ``mpiexec -n N mpsrun --per-node`` and ``mpsrun --hosts localhost``.
PATHS = ["local", "mpiexec", "per-node", "hosts"]
MPSRUN = [sys.executable, "-m", "mpsrun"]


def real_gpu_available() -> tuple[bool, str]:
    """Whether the real driver answers and the real MPS control program exists."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return False, f"no NVIDIA driver ({exc})"
    if count < 1:
        return False, "the driver sees no GPU"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return False, "nvidia-cuda-mps-control is not on PATH"
    return True, ""


# -- waiting ------------------------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition not reached in time",
             proc: subprocess.Popen | None = None, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it is true (and return its value); fail after ``timeout`` seconds, or as soon as
    ``proc`` (the job that should bring the condition about) has ended without it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = predicate()  # it may have come about just before the end
            if value:
                return value
            pytest.fail(f"{what}: the process ended first (exit {proc.returncode})", pytrace=False)
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} within {timeout:g} s", pytrace=False)
        time.sleep(interval)


def wait_ready(directory: Path | str, count: int = 3, timeout: float = 60.0, proc: subprocess.Popen | None = None,
               pattern: str = "*.json") -> None:
    """Until ``count`` ranks have left their report (``pattern``) in ``directory``."""
    wait_for(lambda: len(list(Path(directory).glob(pattern))) >= count, timeout, "the ranks did not start",
             proc=proc)


def settle(fake_gpu: Any, timeout: float = 30.0) -> bool:
    """Wait until the job's processes and session directories are gone (the fake_gpu fixture then asserts it)."""
    deadline = time.monotonic() + timeout
    while fake_gpu.orphans() or fake_gpu.session_dirs():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def wait_processes_gone(fake_gpu: Any, timeout: float = 30.0) -> None:
    """Until no process of this fake machine is left (its daemons have written their last log line): what a job
    run with --keep-logs leaves is then only its directory."""
    wait_for(lambda: not fake_gpu.orphans(), timeout, "the job's processes did not end")


def remove_kept(fake_gpu: Any) -> None:
    """Remove the session directories a --keep-logs job kept, as a user does: ``mpsrun cleanup``."""
    wait_processes_gone(fake_gpu)
    subprocess.run([*MPSRUN, "cleanup"], check=True, capture_output=True, timeout=60)
    assert not fake_gpu.session_dirs()


def control_logs(fake_gpu: Any) -> list[str]:
    """The text of every control daemon log under the fake machine's MPSRUN_TMPDIR."""
    return [p.read_text() for p in fake_gpu.tmpdir.rglob("control.log")]


# -- what ranks report --------------------------------------------------------------------------------------------


def write_atomically(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees all of it or no file (never an empty or partial one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def reports(directory: Path | str) -> dict[int, Any]:
    """Each rank's JSON report in ``directory`` (``<RANK>.json``), by rank."""
    return {int(p.stem): json.loads(p.read_text()) for p in Path(directory).glob("*.json")}


# -- running mpsrun -----------------------------------------------------------------------------------------------


def mpsrun(*args: Any, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``mpsrun ARGS`` to its end, its output captured as text."""
    return subprocess.run([*MPSRUN, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


def mpiexec() -> str:
    """MPICH's mpiexec from the mpich wheel (beside our Python), or the one on PATH; skips the test without one."""
    found = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    if found is None:
        pytest.skip("no mpiexec")
    return found


def fake(*args: str) -> list[str]:
    """The fake CUDA program (tests/fake_mps/fakecuda.py) with ``args``."""
    return [sys.executable, str(FAKECUDA), *args]


def job_argv(path: str, options: list[str], program: list[str], ranks: int = 3) -> list[str]:
    """The command line that runs ``program`` as ``ranks`` ranks on ``path`` (one of PATHS)."""
    if path == "local":
        return [*MPSRUN, "-np", str(ranks), "--launcher", "local", *options, *program]
    if path == "mpiexec":
        return [*MPSRUN, "-np", str(ranks), "--launcher", "mpiexec", "--mpiexec", mpiexec(), *options, *program]
    if path == "per-node":
        return [mpiexec(), "-n", str(ranks), *MPSRUN, "--per-node", *options, *program]
    return [*MPSRUN, "-np", str(ranks), "--hosts", "localhost", "--mpiexec", mpiexec(), *options, *program]


def run_job(path: str, options: list[str], program: list[str], ranks: int = 3, timeout: float = 120,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``program`` as ``ranks`` ranks on ``path``, to its end, its output captured as text."""
    return subprocess.run(job_argv(path, options, program, ranks), capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def run_source(source: str, ranks: int = 3, options: tuple[str, ...] | list[str] = (),
               path: str = "local") -> subprocess.CompletedProcess[str]:
    """Python ``source`` as the ranks of a job on ``path``."""
    return run_job(path, list(options), [sys.executable, "-c", source], ranks=ranks)


def supervisors(job: subprocess.Popen, path: str) -> list[int]:
    """The processes to signal as 'mpsrun': the launcher, or under --per-node every rank's mpsrun (as srun does)."""
    if path != "per-node":
        return [job.pid]
    return [proc.pid for proc in per_node_ranks(job)]


def per_node_ranks(job: subprocess.Popen) -> list[Any]:
    """The per-node mpsrun processes the launcher ``job`` (an mpiexec) started. Not a rank's child caught between
    fork and exec: it still shows its parent's command line, and a signal meant for mpsrun would reach the keeper or
    program it is about to become."""
    import psutil

    found = {}
    for proc in psutil.Process(job.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "--per-node" in proc.cmdline():
                found[proc.pid] = proc
    launched = []
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            if proc.ppid() not in found:
                launched.append(proc)
    return launched


# -- the GPU tier -------------------------------------------------------------------------------------------------


#: A CuPy rank for the GPU tier's fault matrix: it computes, says it is ready (a file in READY_DIR), then rank 1
#: exits 7, is SIGKILLed or segfaults (``exit``, ``kill``, ``segv``), or every rank computes on (``hang``).
GPU_BUSY = (
    "import os, signal, sys, time, cupy\n"
    "x = cupy.ones(1 << 16, dtype=cupy.float32)\n"
    "cupy.cuda.Device().synchronize()\n"
    "open(os.path.join(os.environ['READY_DIR'], os.environ['RANK']), 'w').close()\n"
    "mode, rank = sys.argv[1], os.environ['RANK']\n"
    "if rank == '1' and mode != 'hang':\n"
    "    time.sleep(1)\n"
    "    if mode == 'exit': sys.exit(7)\n"
    "    os.kill(os.getpid(), {'kill': 9, 'segv': 11}[mode])\n"
    "end = time.monotonic() + 60\n"
    "while time.monotonic() < end:\n"
    "    x = x * 1.0000001\n"
    "    cupy.cuda.Device().synchronize()\n"
)


def gpu_mpiexec() -> str:
    """The GPU machine's mpiexec (Open MPI there); skips the test without one."""
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        pytest.skip("no mpiexec")
    return found


def gpu_job_argv(path: str, options: list[str], program: list[str], ranks: int = 3) -> list[str]:
    """As :func:`job_argv`, on the real GPU 0 with --mps on and the machine's mpiexec."""
    mpsrun = [*MPSRUN, "--mps", "on", "--gpus", "0"]
    if path == "local":
        return [*mpsrun, "-np", str(ranks), "--launcher", "local", *options, *program]
    if path == "mpiexec":
        return [*mpsrun, "-np", str(ranks), "--launcher", "mpiexec", "--mpiexec", gpu_mpiexec(), *options, *program]
    if path == "per-node":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return [gpu_mpiexec(), *root, "--oversubscribe", "-np", str(ranks), *mpsrun, "--per-node", *options,
                *program]
    return [*mpsrun, "-np", str(ranks), "--hosts", "localhost", "--mpiexec", gpu_mpiexec(), *options, *program]


def multiprocessing_helper(proc: Any) -> bool:
    """Whether ``proc`` (a psutil.Process) is multiprocessing's resource tracker: the first spawned process of a
    test's own process (an Executor's worker) starts it, and it lives on with that process by design."""
    return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())


def tagged_processes(tag: str, base: Path) -> list[tuple[int, str]]:
    """Live processes carrying MPSRUN_TEST_TAG=``tag``, or an MPS pipe directory under ``base`` (not this process's
    resource tracker, which an Executor's first worker starts with the tag in its environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            environ = proc.environ()
            if environ.get("MPSRUN_TEST_TAG") == tag or str(base) in environ.get("CUDA_MPS_PIPE_DIRECTORY", ""):
                if proc.status() != psutil.STATUS_ZOMBIE and not (
                        proc.ppid() == os.getpid() and multiprocessing_helper(proc)):
                    found.append((proc.pid, proc.info["name"]))
        except psutil.Error:
            continue
    return found


# -- processes of a running job -----------------------------------------------------------------------------------


def descendants(job: subprocess.Popen | int, words: str | None = None) -> list[Any]:
    """The live (not zombie) processes under ``job`` whose command line contains ``words`` (all when None)."""
    import psutil

    found = []
    try:
        children = psutil.Process(job if isinstance(job, int) else job.pid).children(recursive=True)
    except psutil.Error:
        return []
    for proc in children:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and (words is None or words in " ".join(proc.cmdline())):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def running(job: subprocess.Popen | int, argv: list[str]) -> list[Any]:
    """The live processes under ``job`` running ``argv`` (its program named as on a PATH search, or by full path)."""
    import psutil

    found = []
    for proc in descendants(job):
        with contextlib.suppress(psutil.Error):  # it ended meanwhile
            line = proc.cmdline()
            if line[:1] and os.path.basename(line[0]) == argv[0] and line[1:] == argv[1:]:
                found.append(proc)
    return found


def handles(proc: Any, sig: int) -> bool:
    """Whether ``proc`` has a handler of its own for ``sig`` (mpsrun's are installed as its entry point starts)."""
    try:
        with open(f"/proc/{proc.pid}/status") as status:
            caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (sig - 1)))


class Output:
    """Collects a running process's text stream (its stderr, say) in a thread, so a test can wait for a line."""

    def __init__(self, stream: Any) -> None:
        import threading

        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)
        stream.close()

    def wait_for(self, words: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
        """Until a line holding ``words`` has come."""
        wait_for(lambda: any(words in line for line in list(self.lines)), timeout, f"no line said {words!r}",
                 proc=proc)

    def text(self, timeout: float = 60.0) -> str:
        """All of it, once the stream has ended."""
        self._thread.join(timeout)
        return "".join(self.lines)


# -- building mpsrun from this checkout ----------------------------------------------------------------------------


@contextlib.contextmanager
def locked(anchor: Path) -> Any:
    """An exclusive lock among this run's processes (xdist's workers), taken on a file that it does not change."""
    with open(anchor, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def building_from_source() -> Any:
    """Held while pip builds mpsrun from this checkout: its builds share build/ in the tree, so two at once (two
    xdist workers) break each other."""
    return locked(ROOT / "pyproject.toml")


def other_user_venv() -> Path:
    """Where this test run's second user gets its Python (tests/test_other_users.py); removed when the run ends."""
    return Path(f"/tmp/mpsrun-other-venv-{os.environ.get('MPSRUN_TEST_RUN', os.getpid())}")


# -- what MPICH's mpiexec leaves in /tmp ----------------------------------------------------------------------------


def nccl_version(library: str) -> tuple[int, int, int]:
    """The version of the NCCL in ``library``, as it reports it (2.31.2 is 23102)."""
    import ctypes

    code = ctypes.c_int()
    if ctypes.CDLL(library).ncclGetVersion(ctypes.byref(code)) != 0:
        pytest.fail(f"ncclGetVersion failed in {library}")
    return code.value // 10000, code.value // 100 % 100, code.value % 100


def shared_gpu_nccl() -> list[str]:
    """mpsrun options that give the ranks an NCCL of 2.30 or later, which can put several ranks on one GPU: torch's
    own when it is one, else the library MPSRUN_TEST_NCCL_LIB names (preloaded; tools/nccl_wheel.sh carries one to
    the GPU machine). Skips the test, naming the versions, where there is none."""
    torch = pytest.importorskip("torch")
    own = torch.cuda.nccl.version()
    if tuple(own[:2]) >= (2, 30):
        return []
    library = os.environ.get("MPSRUN_TEST_NCCL_LIB")
    if not library:
        pytest.skip(f"torch's NCCL is {'.'.join(map(str, own))}, and MPSRUN_TEST_NCCL_LIB names no newer one")
    found = nccl_version(library)
    if found[:2] < (2, 30):
        pytest.skip(f"MPSRUN_TEST_NCCL_LIB is NCCL {'.'.join(map(str, found))}: older than 2.30")
    return ["-x", f"LD_PRELOAD={library}"]


def daemon_session(fake_gpu: Any) -> Path:
    """The one session directory whose record names MPS daemons (a --hosts job also has its controller's, which holds
    the record of its mpiexec alone)."""
    found = [root for root in fake_gpu.session_dirs()
             if json.loads((root / "session.json").read_text()).get("daemons")]
    assert len(found) == 1, fake_gpu.session_dirs()
    return found[0]


def cluster_answers() -> bool:
    """Whether a Slurm cluster answers here (one with an idle node)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "idle" in out.stdout
