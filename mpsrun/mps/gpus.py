"""What the NVIDIA driver says about the GPUs, through NVML (``import pynvml``).

This is the one place mpsrun talks to NVML. Everything else sees plain
:class:`GPU` records. ``nvidia-smi`` text is never parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn

from mpsrun.config.values import GpuList
from mpsrun.errors import ConfigError, GPUError, GPUNotFoundError, NoDriverError
from mpsrun.exitcodes import ExitCode
from mpsrun.runtime.interrupts import uninterrupted
from mpsrun.runtime.processes import set_parent_death_signal

__all__ = [
    "GPU",
    "DriverInfo",
    "compute_processes",
    "driver_info",
    "drop_read_ahead",
    "kept_until_exit",
    "list_gpus",
    "mps_client_memory",
    "nvml_kept",
    "parse_visible_devices",
    "process_memory",
    "read_ahead",
    "select_gpus",
    "utilization",
    "visible_gpus",
]

_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
#: CUDA cores per SM by compute capability: NVML gives a GPU's cores, not its SMs (its attributes call answers for MIG
#: instances only). From NVIDIA's CUDA Programming Guide, "Compute Capabilities" (arithmetic instruction throughput).
_CORES_PER_SM = {(7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
                 (10, 0): 128, (12, 0): 128}


class GPU(NamedTuple):
    """One physical GPU as NVML reports it. ``index`` is NVML's (PCI bus) order."""

    index: int  # type: ignore[assignment]  # NVML's name; it shadows tuple.index, which nothing calls
    uuid: str
    name: str
    memory_total: int
    compute_mode: str
    mig_enabled: bool
    memory_free: int = 0  # when it was looked at (for --mem-limit auto)
    multiprocessors: int | None = None  # SMs, where NVML says (for NCCL's block cap on a shared GPU)


class DriverInfo(NamedTuple):
    """The driver version and the newest CUDA version it supports (e.g. ``"13.0"``)."""

    driver_version: str
    cuda_version: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_keeping = 0  # open nvml_kept() blocks
_kept = False  # an initialisation they hold
_kept_lock = threading.Lock()  # NVML's reference is the process's, whichever thread queries


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """Initialise NVML for the duration of a query; NVML reference-counts init/shutdown."""
    global _kept
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a hard dependency
        raise NoDriverError("nvidia-ml-py is not installed (pip install nvidia-ml-py)", reason=str(exc)) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NoDriverError(
            f"no usable NVIDIA driver: NVML failed to initialise ({_text(exc)})", reason=_text(exc)
        ) from exc
    with _kept_lock:
        if _keeping and not _kept:  # one more reference, held until the nvml_kept() blocks close
            pynvml.nvmlInit()
            _kept = True
    try:
        yield pynvml
    except pynvml.NVMLError as exc:
        raise GPUError(f"NVML query failed: {_text(exc)}") from exc
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


@contextlib.contextmanager
def nvml_kept() -> Iterator[None]:
    """NVML stays initialised from the block's first query to its end, so each later one costs no
    initialisation; a block that makes none (a job that ends before its first look) initialises nothing."""
    global _keeping, _kept
    _keeping += 1
    try:
        yield
    finally:
        _keeping -= 1
        with _kept_lock:
            if not _keeping and _kept:
                _kept = False
                import pynvml

                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()


def kept_until_exit() -> None:
    """NVML, once initialised, stays so until the process ends: for the ``mpsrun`` command, which ends with
    ``os._exit`` after its job, where NVML's shutdown (it waits for NVML's own threads) would only delay its end."""
    global _keeping
    _keeping += 1


def driver_info() -> DriverInfo:
    """Return the driver and CUDA versions; raise :class:`NoDriverError` without a driver."""
    with _nvml() as nvml:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
    return DriverInfo(driver_version=driver, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}")


def _describe(nvml: Any, index: int) -> GPU:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    try:
        mig_current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        mig = bool(mig_current)
    except nvml.NVMLError:  # GPUs without MIG support answer "not supported"
        mig = False
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return GPU(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total=int(memory.total),
        compute_mode=_COMPUTE_MODES.get(int(nvml.nvmlDeviceGetComputeMode(handle)), "Unknown"),
        mig_enabled=mig,
        memory_free=int(memory.free),
        multiprocessors=_multiprocessors(nvml, handle),
    )


def _multiprocessors(nvml: Any, handle: Any) -> int | None:
    """The GPU's SMs: its CUDA cores over the cores per SM of its compute capability; None where NVML cannot say."""
    try:
        cores = int(nvml.nvmlDeviceGetNumGpuCores(handle))
        per_sm = _CORES_PER_SM.get(tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    except (AttributeError, nvml.NVMLError):  # an older driver or nvidia-ml-py
        return None
    return cores // per_sm if per_sm and cores > 0 else None


def _query() -> list[GPU]:
    with _nvml() as nvml:
        return [_describe(nvml, i) for i in range(int(nvml.nvmlDeviceGetCount()))]


class _ReadAhead:
    """The GPU list, read by a forked child while the caller does other work. A child, not a thread: a thread's
    import of pynvml would hold the interpreter's lock meanwhile, and NVML loaded here would make each fork of a
    local rank's supervisor slower (docs/benchmarks.md). Forked only while this process has no other thread."""

    def __init__(self) -> None:
        read, write = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        try:
            self.pid = os.fork()
        except OSError:  # no process to spare now (ulimit -u): the list is read when asked for
            os.close(read)
            os.close(write)
            raise
        if self.pid == 0:
            os.close(read)
            _answer_in_child(write, parent)
        os.close(write)
        self.pipe = read

    def take(self) -> list[GPU] | None:
        """The child's list; None when it failed (the caller then asks NVML itself, and says what that says)."""
        try:
            with open(self.pipe, "rb", closefd=False) as reply:
                data = reply.read()
            _, status = os.waitpid(self.pid, 0)
        except BaseException:  # interrupted while it waited: the child ends with the job
            self.drop()
            raise
        os.close(self.pipe)
        try:
            return [GPU(**item) for item in json.loads(data)] if status == 0 else None
        except (ValueError, TypeError):
            return None

    def drop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # our child, not reaped yet: the pid is still its own
        with contextlib.suppress(ChildProcessError):  # reaped already
            os.waitpid(self.pid, 0)
        os.close(self.pipe)


def _answer_in_child(pipe: int, parent: int) -> NoReturn:
    code = ExitCode.FAILED
    try:
        set_parent_death_signal(signal.SIGKILL, parent)  # a job killed outright does not wait for its NVML
        quiet = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):  # nor does whoever reads the job's output until its end
            os.dup2(quiet, fd)
        kept_until_exit()  # the child ends with os._exit: no shutdown
        data = json.dumps([gpu._asdict() for gpu in _query()]).encode()
        with open(pipe, "wb") as out:
            out.write(data)
        code = ExitCode.OK
    finally:  # whatever happened (an NVML error, a signal): the parent asks again itself
        os._exit(code)


_read_ahead: _ReadAhead | None = None


def read_ahead() -> None:
    """Start reading the GPU list now, for the next :func:`list_gpus` to take (:func:`drop_read_ahead` ends one never
    taken): NVML's import and initialisation then overlap what a job does before it plans its ranks."""
    global _read_ahead
    if _read_ahead is None and threading.active_count() == 1:  # a fork copies no other thread, nor the locks it holds
        with uninterrupted(), contextlib.suppress(OSError):  # on record before a signal is acted on
            _read_ahead = _ReadAhead()


def drop_read_ahead() -> None:
    """End a reading nobody took (the job ended before it planned its ranks)."""
    global _read_ahead
    ahead, _read_ahead = _read_ahead, None
    if ahead is not None:
        ahead.drop()


def list_gpus() -> list[GPU]:
    """Every GPU the driver knows, in NVML order, ignoring ``CUDA_VISIBLE_DEVICES``."""
    global _read_ahead
    ahead, _read_ahead = _read_ahead, None
    gpus = ahead.take() if ahead is not None else None
    return _query() if gpus is None else gpus


def parse_visible_devices(value: str | None, gpus: Sequence[GPU]) -> list[GPU]:
    """Apply a ``CUDA_VISIBLE_DEVICES`` value to the physical GPUs, as CUDA does.

    Entries are indices or (prefixes of) ``GPU-`` UUIDs; CUDA stops at the first entry
    that names no device, so this does too. ``None`` means the variable is unset.
    """
    if value is None:
        return list(gpus)
    chosen: list[GPU] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.startswith("MIG-"):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); mpsrun does not manage MPS on MIG yet",
                setting="CUDA_VISIBLE_DEVICES",
                value=value,
            )
        if entry.startswith("GPU-"):
            matches = [g for g in gpus if g.uuid.startswith(entry)]
            found = matches[0] if len(matches) == 1 else None
        elif entry.isdigit():
            found = next((g for g in gpus if g.index == int(entry)), None)
        else:
            found = None
        if found is None or found in chosen:
            break
        chosen.append(found)
    return chosen


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[GPU]:
    """The GPUs this process may use: the driver's list filtered by ``CUDA_VISIBLE_DEVICES``."""
    env = os.environ if environ is None else environ
    return parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"), list_gpus())


def select_gpus(requested: GpuList, visible: Sequence[GPU]) -> list[GPU]:
    """The GPUs ``requested`` names (as :func:`mpsrun.config.values.parse_gpus` gives them): positions among
    ``visible`` (as CUDA numbers them) or UUID prefixes; None selects every visible GPU. Raises
    :class:`GPUNotFoundError` naming what exists, or :class:`ConfigError` for a prefix that names several."""
    if requested is None:
        if not visible:
            raise GPUNotFoundError("no GPU is visible (check CUDA_VISIBLE_DEVICES)", requested=None)
        return list(visible)
    chosen = [_find(item, visible) for item in requested]
    if len(set(chosen)) < len(chosen):
        raise ConfigError(f"GPUs {list(requested)} name one GPU twice", setting="gpus", value=list(requested))
    return chosen


def _find(item: int | str, visible: Sequence[GPU]) -> GPU:
    if isinstance(item, str):
        matches = [g for g in visible if g.uuid.startswith(item)]
        if len(matches) > 1:
            raise ConfigError(f"GPU {item!r} names {len(matches)} GPUs ({', '.join(g.uuid for g in matches)}); "
                              "give more of the UUID", setting="gpus", value=item)
        found = matches[0] if matches else None
    else:
        found = visible[item] if 0 <= item < len(visible) else None
    if found is None:
        names = [f"{i}: {g.name} {g.uuid}" for i, g in enumerate(visible)] or ["none"]
        raise GPUNotFoundError(f"GPU {item!r} is not visible; visible GPUs: {'; '.join(names)}", requested=item,
                               visible=[g.uuid for g in visible])
    return found


def memory_free(uuid: str) -> int:
    """The GPU's free memory now, in bytes."""
    with _nvml() as nvml:
        return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(uuid)).free)


def _contexts(nvml: Any, uuid: str) -> Iterator[tuple[int, bool, int | None]]:
    """NVML's two lists of the GPU's contexts: ``(pid, listed as an MPS client, device memory in bytes or None)``.

    NVML lists MPS clients (type ``M+C``) both as compute processes and as MPS compute processes, each with its
    memory (its allocations and its context), and the MPS server and plain CUDA processes (type ``C``) only as
    compute processes (recorded on an H100 and on two H200s).
    """
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    for name, is_mps in (("nvmlDeviceGetComputeRunningProcesses", False),
                         ("nvmlDeviceGetMPSComputeRunningProcesses", True)):
        query = getattr(nvml, name, None)
        if query is None:
            continue
        try:
            processes = query(handle)
        except nvml.NVMLError_NotSupported:
            continue
        for process in processes:
            used = process.usedGpuMemory
            yield int(process.pid), is_mps, None if used is None else int(used)


def compute_processes(uuid: str) -> dict[int, bool]:
    """Processes holding a CUDA context on the GPU: ``{pid: is_mps_client}``."""
    found: dict[int, bool] = {}
    with _nvml() as nvml:
        for pid, is_mps, _ in _contexts(nvml, uuid):
            found[pid] = found.get(pid, False) or is_mps
    return found


def process_memory(uuid: str) -> dict[int, int]:
    """Each process holding a CUDA context on the GPU, with its device memory in bytes as NVML counts it (a process
    whose memory NVML does not give is left out)."""
    found: dict[int, int] = {}
    with _nvml() as nvml:
        for pid, _, used in _contexts(nvml, uuid):
            if used is not None:
                found[pid] = max(found.get(pid, 0), used)
    return found


def utilization(uuid: str) -> int | None:
    """The GPU's SM activity over NVML's last sample period, in percent; None where NVML cannot say. Under MPS it is
    the whole GPU's: NVML charges every client's work to the MPS server and has no figure per client."""
    with _nvml() as nvml:
        try:
            return int(nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByUUID(uuid)).gpu)
        except nvml.NVMLError_NotSupported:
            return None


def mps_client_memory(uuid: str) -> dict[int, int] | None:
    """Each MPS client on the GPU and its device memory in bytes (its allocations and its context, as NVML counts
    them); None when this driver's NVML cannot list MPS clients."""
    with _nvml() as nvml:
        query = getattr(nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if query is None:
            return None
        try:
            processes = query(nvml.nvmlDeviceGetHandleByUUID(uuid))
        except nvml.NVMLError_NotSupported:
            return None
        return {int(process.pid): int(process.usedGpuMemory or 0) for process in processes}
