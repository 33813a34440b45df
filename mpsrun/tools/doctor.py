"""``mpsrun doctor``: can MPS work here, and if not, why not.

Everything comes from NVML, psutil and the file system; no ``nvidia-smi`` text is parsed
and nothing is changed. Exit status 0 when MPS is usable, 3 when it is not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import psutil

from mpsrun.config.commandline import OneLineParser
from mpsrun.errors import GPUError, MPSUnavailableError, NoDriverError
from mpsrun.job import mpiexec as mpi
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import find_control_executable
from mpsrun.runtime.output import printable

__all__ = ["gather", "main", "render"]

EXIT_USABLE, EXIT_UNUSABLE = 0, 3
_GIB = 1 << 30


def _mps_processes() -> list[dict[str, Any]]:
    """Running nvidia-cuda-mps-* processes: whose they are and whether an mpsrun session owns them."""
    found = []
    uid = os.getuid()
    marker = f"/mpsrun-{uid}/"
    for proc in psutil.process_iter(["pid", "name", "uids", "username"]):
        name = proc.info["name"] or ""
        if not name.startswith("nvidia-cuda-mps"):
            continue
        try:
            pipe = proc.environ().get("CUDA_MPS_PIPE_DIRECTORY", "")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pipe = ""
        owner = proc.info["uids"].real if proc.info["uids"] else -1
        found.append(
            {
                "pid": proc.info["pid"],
                "name": name,
                "user": proc.info["username"],
                "mine": owner == uid,
                "mpsrun": owner == uid and marker in pipe,
                "pipe_dir": pipe or None,
            }
        )
    return found


def _cupy() -> dict[str, Any] | None:
    """CuPy's version and the CUDA runtime it was built for, asked in a child (importing is slow)."""
    code = (
        "import cupy; v = cupy.cuda.runtime.runtimeGetVersion(); "
        "print(cupy.__version__, f'{v // 1000}.{v % 1000 // 10}')"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        error = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        return {"importable": False, "error": error}
    version, runtime = out.stdout.split()
    return {"importable": True, "version": version, "cuda_runtime": runtime}


def _gpu_entry(gpu: gpu_info.GPU, visible: list[gpu_info.GPU], servers: dict[int, dict[str, Any]],
               warnings: list[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory_gib": round(gpu.memory_total / _GIB, 1),
        "compute_mode": gpu.compute_mode,
        "mig": gpu.mig_enabled,
        "visible": gpu in visible,
    }
    try:
        on_gpu = set(gpu_info.compute_processes(gpu.uuid))
    except GPUError:
        on_gpu = set()
    try:
        entry["nvml_lists_mps_clients"] = gpu_info.mps_client_memory(gpu.uuid) is not None
    except GPUError:
        entry["nvml_lists_mps_clients"] = None
    if entry["nvml_lists_mps_clients"] is False:
        warnings.append(f"GPU {gpu.index}: this driver's NVML cannot list MPS clients: mpsrun proves a rank's MPS "
                        "connection from its daemon's log only, and no rank's device memory can be known")
    foreign = [servers[p] for p in on_gpu if p in servers and not servers[p]["mine"]]
    entry["foreign_mps_servers"] = [{"pid": s["pid"], "user": s["user"]} for s in foreign]
    if foreign:
        warnings.append(
            f"GPU {gpu.index} has an MPS server of another user ({foreign[0]['user']}): its clients and yours "
            "would be time-sliced"
        )
    entry["usable"] = gpu.compute_mode != "Prohibited" and not gpu.mig_enabled
    if gpu.compute_mode == "Prohibited":
        warnings.append(f"GPU {gpu.index} is in compute mode Prohibited: no CUDA context can be made on it")
    if gpu.mig_enabled:
        warnings.append(f"GPU {gpu.index} has MIG enabled: mpsrun does not manage MPS on MIG instances yet")
    return entry


def _gpus(report: dict[str, Any], problems: list[str], warnings: list[str]) -> None:
    """The driver, each GPU, and what keeps MPS from working on them."""
    try:
        driver = gpu_info.driver_info()
        report["driver"] = {"driver_version": driver.driver_version, "cuda_version": driver.cuda_version}
        physical = gpu_info.list_gpus()
        visible = gpu_info.parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), physical)
    except (NoDriverError, GPUError) as exc:
        report["driver"] = None
        physical, visible = [], []
        problems.append(str(exc))
    servers = {p["pid"]: p for p in report["mps_processes"] if p["name"] == "nvidia-cuda-mps-server"}
    report["gpus"] = [_gpu_entry(gpu, visible, servers, warnings) for gpu in physical]
    if report["driver"] is not None and not visible:
        problems.append("no GPU is visible (check CUDA_VISIBLE_DEVICES)")
    elif visible and not any(g["usable"] for g in report["gpus"] if g["visible"]):
        problems.append("no visible GPU can run MPS (compute mode Prohibited or MIG)")


def _software(report: dict[str, Any], problems: list[str]) -> None:
    """The control program, /dev/shm, MPI launchers, mpi4py and CuPy."""
    try:
        report["control_executable"] = find_control_executable()
    except MPSUnavailableError as exc:
        report["control_executable"] = None
        problems.append(str(exc))
    try:
        shm = shutil.disk_usage("/dev/shm")
        report["dev_shm"] = {"free_gib": round(shm.free / _GIB, 1), "total_gib": round(shm.total / _GIB, 1)}
    except OSError:
        report["dev_shm"] = None
    launchers = {}
    for name in ("mpiexec", "mpirun", "srun"):
        path = shutil.which(name)
        if path:
            launchers[name] = {"path": path, "flavour": "slurm" if name == "srun" else mpi.detect_flavour(path)}
    report["mpi_launchers"] = launchers
    try:
        report["mpi4py"] = importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        report["mpi4py"] = None
    report["cupy"] = _cupy()


def _nvml_bytecode(warnings: list[str]) -> None:
    """pynvml without its compiled bytecode, that no import can write (PYTHONDONTWRITEBYTECODE, a read-only
    install): every job compiles it again while it starts, and holds the interpreter's lock meanwhile."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return
    cached = importlib.util.cache_from_source(spec.origin, optimization="")  # what the command, run without -O, reads
    try:
        current = os.stat(cached).st_mtime >= os.stat(spec.origin).st_mtime
    except OSError:
        current = False
    if not current:
        warnings.append(f"{spec.origin} has no current compiled bytecode, so every mpsrun job compiles it as it "
                        f"starts; '{sys.executable} -m compileall {spec.origin}' writes it once")


def gather() -> dict[str, Any]:
    """Everything doctor knows, as plain data (the ``--json`` output)."""
    problems: list[str] = []  # MPS cannot work
    warnings: list[str] = []  # it can, with a caveat
    report: dict[str, Any] = {"problems": problems, "warnings": warnings, "mps_processes": _mps_processes()}
    _gpus(report, problems, warnings)
    _software(report, problems)
    _nvml_bytecode(warnings)  # after _gpus: an import that could write the bytecode has
    report["settings"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MPSRUN_")}
    report["usable"] = not problems
    return report


def render(report: dict[str, Any]) -> str:
    """The report as a two-column table for people."""
    rows: list[tuple[str, str]] = []
    driver = report["driver"]
    rows.append(("driver", f"{driver['driver_version']} (CUDA {driver['cuda_version']})" if driver else "none"))
    for gpu in report["gpus"]:
        foreign = ", ".join(f"server {s['pid']} of {s['user']}" for s in gpu["foreign_mps_servers"])
        rows.append(
            (
                f"GPU {gpu['index']}",
                f"{gpu['name']}, {gpu['uuid']}, {gpu['memory_gib']} GiB, compute mode {gpu['compute_mode']}, "
                f"MIG {'on' if gpu['mig'] else 'off'}{'' if gpu['visible'] else ', not visible'}"
                + (f"; other users' MPS: {foreign}" if foreign else ""),
            )
        )
    rows.append(("MPS control", report["control_executable"] or "not found on PATH"))
    processes = report["mps_processes"]
    if processes:
        for proc in processes:
            whose = "mpsrun session" if proc["mpsrun"] else "yours" if proc["mine"] else f"user {proc['user']}"
            rows.append(("MPS process", f"{proc['pid']} {proc['name']} ({whose})"))
    else:
        rows.append(("MPS processes", "none running"))
    shm = report["dev_shm"]
    rows.append(("/dev/shm", f"{shm['free_gib']} GiB free of {shm['total_gib']} GiB" if shm else "not found"))
    launchers = report["mpi_launchers"]
    rows.append(("MPI launchers", ", ".join(f"{v['path']} ({v['flavour']})" for v in launchers.values()) or "none"))
    rows.append(("mpi4py", report["mpi4py"] or "not installed"))
    cupy = report["cupy"]
    if cupy is None or not cupy.get("importable"):
        rows.append(("CuPy", "not importable" + (f" ({cupy['error']})" if cupy else "")))
    else:
        rows.append(("CuPy", f"{cupy['version']} (CUDA runtime {cupy['cuda_runtime']})"))
    settings = report["settings"]
    rows.append(("settings", " ".join(f"{k}={v}" for k, v in settings.items()) or "no MPSRUN_* variables set"))
    width = max(len(name) for name, _ in rows)
    verdict = (
        "mpsrun doctor: MPS can be used here"
        if report["usable"]
        else "mpsrun doctor: MPS cannot be used here: " + "; ".join(report["problems"])
    )
    lines = [printable(verdict), *(f"{name:<{width}}  {printable(value)}" for name, value in rows)]
    lines += [f"warning: {printable(w)}" for w in report["warnings"]]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = OneLineParser(prog="mpsrun doctor", description="Tell whether MPS can work here, and why not.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = gather()
    print(json.dumps(report, indent=1) if args.json else render(report))
    return EXIT_USABLE if report["usable"] else EXIT_UNUSABLE
