"""A test double of ``pynvml`` (nvidia-ml-py) for machines without a GPU.

Reads ``$MPSRUN_FAKE_NVML/gpus.json`` (a list of {uuid, name, memory_total,
compute_mode, mig}) and the compute processes registered under
``$MPSRUN_FAKE_NVML/procs/<pid>`` by fake CUDA programs and the fake MPS server.
Without that variable (or file) ``nvmlInit`` fails as it does on a machine with no
driver. Only the calls mpsrun makes exist here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_FOUND = 6
_MESSAGES = {
    2: "Invalid Argument",
    3: "Not Supported",
    6: "Not Found",
    12: "NVML Shared Library Not Found",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"error {self.value}")


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


_gpus: list[dict] | None = None


def _root() -> Path:
    return Path(os.environ.get("MPSRUN_FAKE_NVML", "/nonexistent"))


_references = 0  # NVML counts init/shutdown: only the first init of a process (or after the last shutdown) is real


def nvmlInit() -> None:
    global _gpus, _references
    if os.environ.get("FAKE_NVML_INIT_WAIT"):  # a driver slow to answer
        import time

        time.sleep(float(os.environ["FAKE_NVML_INIT_WAIT"]))
    try:
        _gpus = json.loads((_root() / "gpus.json").read_text())
    except (OSError, ValueError):
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None
    _references += 1
    if _references == 1 and os.environ.get("FAKE_NVML_INIT_LOG"):  # tests count real initialisations
        with open(os.environ["FAKE_NVML_INIT_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")


def nvmlShutdown() -> None:
    global _references
    _references = max(0, _references - 1)
    if _references == 0 and os.environ.get("FAKE_NVML_SHUTDOWN_LOG"):  # tests count real shutdowns
        with open(os.environ["FAKE_NVML_SHUTDOWN_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")


def _check() -> list[dict]:
    if _gpus is None:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    return _gpus


def nvmlSystemGetDriverVersion() -> str:
    _check()
    return "580.159.04"


def nvmlSystemGetCudaDriverVersion() -> int:
    _check()
    return 13000


def nvmlDeviceGetCount() -> int:
    return len(_check())


def nvmlDeviceGetHandleByIndex(index: int) -> dict:
    gpus = _check()
    if not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return gpus[index]


def nvmlDeviceGetHandleByUUID(uuid: str) -> dict:
    for gpu in _check():
        if gpu["uuid"] == uuid:
            return gpu
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle: dict) -> str:
    return handle["uuid"]


def nvmlDeviceGetName(handle: dict) -> str:
    return handle.get("name", "Fake GPU")


def nvmlDeviceGetMemoryInfo(handle: dict) -> SimpleNamespace:
    """Read now, as the driver's figure is (tests change the free memory while a job runs)."""
    try:
        now = next(g for g in json.loads((_root() / "gpus.json").read_text()) if g["uuid"] == handle["uuid"])
    except (OSError, ValueError, StopIteration):
        now = handle
    total = int(now.get("memory_total", 80 << 30))
    free = int(now.get("memory_free", total))
    return SimpleNamespace(total=total, free=free, used=total - free)


def nvmlDeviceGetUtilizationRates(handle: dict) -> SimpleNamespace:
    # "utilization": [sm, memory] in gpus.json (read now, as memory is); idle by default.
    try:
        now = next(g for g in json.loads((_root() / "gpus.json").read_text()) if g["uuid"] == handle["uuid"])
    except (OSError, ValueError, StopIteration):
        now = handle
    sm, memory = now.get("utilization", (0, 0))
    return SimpleNamespace(gpu=int(sm), memory=int(memory))


def nvmlDeviceGetComputeMode(handle: dict) -> int:
    return int(handle.get("compute_mode", 0))


def nvmlDeviceGetMigMode(handle: dict) -> tuple[int, int]:
    if "mig" not in handle:
        raise NVMLError_NotSupported()
    return (int(handle["mig"]), int(handle["mig"]))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _procs(handle: dict, kinds: tuple[str, ...]) -> list[SimpleNamespace]:
    found = []
    directory = _root() / "procs"
    for entry in sorted(directory.glob("*")) if directory.is_dir() else []:
        try:
            info = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if info["uuid"] == handle["uuid"] and info["type"] in kinds and _alive(int(entry.name)):
            found.append(SimpleNamespace(pid=int(entry.name), usedGpuMemory=info["mib"] << 20))
    return found


def nvmlDeviceGetComputeRunningProcesses(handle: dict) -> list[SimpleNamespace]:
    if os.environ.get("FAKE_NVML_LOOK_LOG"):  # tests count the looks that can find a context without MPS
        with open(os.environ["FAKE_NVML_LOOK_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")
    # Recorded on the H100: this lists the MPS server, the MPS clients and plain CUDA processes.
    return _procs(handle, ("C", "M+C"))


def nvmlDeviceGetMPSComputeRunningProcesses(handle: dict) -> list[SimpleNamespace]:
    # Recorded on the H100: only the MPS clients, not the server, each with its memory (its allocations and its
    # context), as the plain list gives it. FAKE_NVML_NO_MPS_LIST: a driver that cannot list them.
    if os.environ.get("FAKE_NVML_NO_MPS_LIST"):
        raise NVMLError_NotSupported()
    return _procs(handle, ("M+C",))


def nvmlDeviceGetNumGpuCores(handle: dict) -> int:
    # An H100 SXM's by default (132 SMs of 128 cores); "cores": null in gpus.json: a driver that cannot say.
    if handle.get("cores", 0) is None:
        raise NVMLError_NotSupported()
    return int(handle.get("cores", 16896))


def nvmlDeviceGetCudaComputeCapability(handle: dict) -> tuple[int, int]:
    major, minor = handle.get("compute_capability", (9, 0))
    return int(major), int(minor)
