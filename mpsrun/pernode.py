"""Per-node mode: ``srun -n 8 mpsrun --per-node python sim.py`` (or under ``mpiexec -n 8``).

Every process is one rank. On each node the first local rank to take the node's file lock
starts that node's MPS daemons (one per GPU) and waits for their servers while holding
the lock, so the other local ranks, queued on the lock, find a ready session. Each rank
registers itself (pid and start time) in the session's ``session.json``, runs its command,
and unregisters; the last one out stops the daemons and removes the directory. Holders that
died are pruned by pid and start time, so a killed rank still releases its reference.

The lock and the session are keyed by the job and step (``SLURM_JOB_ID.SLURM_STEP_ID``, else
the MPI launcher's job id, else the local launcher process) and by the node, under the
node-local session directory (``$MPSRUN_TMPDIR``). ``MPSRUN_NODE_ID`` overrides the node's
name: tests use it, with a separate ``MPSRUN_TMPDIR``, to simulate several nodes on one machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock
import psutil

from mpsrun import gpus as gpu_info
from mpsrun import mpi, registry
from mpsrun.daemon import ControlDaemon, find_control_executable
from mpsrun.errors import DaemonTimeoutError, MPSError
from mpsrun.limits import client_variables
from mpsrun.paths import SessionDirs, base_directory, make_user_root, user_root, validate_base
from mpsrun.supervisor import JobResult, RankSpec, Supervisor

__all__ = ["job_key", "local_placement", "run_per_node"]

log = logging.getLogger("mpsrun")

_JOB_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")
_LOCAL_SIZE_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "PALS_LOCAL_SIZE",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
)


def job_key(env: Mapping[str, str]) -> str:
    """What all local ranks of one job step share: Slurm's job and step, the MPI job, or the launching process."""
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    for name in _JOB_VARIABLES:
        if env.get(name):
            return f"{name}-{env[name]}"
    return f"ppid-{os.getppid()}"  # local ranks of mpiexec share their launcher process on the node


def local_placement(env: Mapping[str, str], ngpus: int, policy: str) -> tuple[int, int]:
    """(local rank, GPU position) from the launcher's variables; block needs the local size, else round-robin."""
    local = mpi.first_int(env, mpi.LOCAL_RANK_VARIABLES)
    if local is None:
        raise MPSError(f"--per-node: no local-rank variable from the launcher ({', '.join(mpi.LOCAL_RANK_VARIABLES)})")
    size = mpi.first_int(env, _LOCAL_SIZE_VARIABLES)
    if policy == "block" and size:
        return local, min(ngpus - 1, local * ngpus // size)
    return local, local % ngpus


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "create_time": psutil.Process().create_time()}


def _alive(holder: Mapping[str, Any]) -> bool:
    return registry.matching_process(holder.get("pid"), holder.get("create_time")) is not None


class NodeSession:
    """This node's shared session for one job step."""

    def __init__(self, base: Path, key: str, node: str) -> None:
        digest = hashlib.sha256(f"{node}:{key}".encode()).hexdigest()[:8]
        self.base = base
        self.name = f"j{digest}"
        self.root = user_root(base) / self.name
        self.lock = filelock.FileLock(str(user_root(base) / f"{self.name}.lock"))
        self.info_file = self.root / "session.json"

    def _read(self) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = json.loads(self.info_file.read_text())
            return info
        except (OSError, ValueError):
            return None

    def _write(self, info: dict[str, Any]) -> None:
        SessionDirs(root=self.root).write_info(info)

    def _start(self, gpus: Sequence[gpu_info.GPU], settings: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        if self.root.exists():  # a previous step's leftovers: nobody holds them (checked by the caller)
            self._teardown(self._read() or {})
        dirs = SessionDirs.create(self.base, [g.index for g in gpus], name=self.name)
        info: dict[str, Any] = {
            **_me(),
            "uid": os.getuid(),
            "started": time.time(),
            "per_node": True,
            "holders": [],
            "daemons": [],
            "gpus": [g.uuid for g in gpus],
        }
        self._write(info)
        try:
            for gpu in gpus:
                daemon = ControlDaemon(
                    gpu_uuid=gpu.uuid,
                    pipe_dir=dirs.pipe_dir(gpu.index),
                    log_dir=dirs.log_dir(gpu.index),
                    outlive_parent=True,
                )
                daemon.start(timeout=timeout)
                assert daemon.pid is not None
                info["daemons"].append(
                    {
                        "gpu": gpu.uuid,
                        "pid": daemon.pid,
                        "pipe_dir": str(daemon.pipe_dir),
                        "log_dir": str(daemon.log_dir),
                        "create_time": psutil.Process(daemon.pid).create_time(),
                    }
                )
                self._write(info)
                daemon.set_defaults(settings.get("thread_percentage"), settings.get("mem_limit"))
                daemon.start_server(timeout=timeout)
        except BaseException:
            self._teardown(info)
            raise
        return info

    def _teardown(self, info: Mapping[str, Any]) -> None:
        for entry in info.get("daemons", []):
            registry.stop_daemon(
                registry.DaemonRecord(
                    gpu=entry["gpu"],
                    pid=entry["pid"],
                    create_time=entry["create_time"],
                    pipe_dir=Path(entry["pipe_dir"]),
                    alive=True,
                )
            )
        SessionDirs(root=self.root).remove()

    def join(self, gpus: Sequence[gpu_info.GPU], settings: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Register this process; the first local rank starts the daemons (others wait on the lock)."""
        validate_base(self.base)
        make_user_root(self.base)  # 0700 and checked, before filelock would make it with default modes
        try:
            with self.lock.acquire(timeout=timeout):
                info = self._read()
                holders = [h for h in (info or {}).get("holders", []) if _alive(h)]
                if info is None or not holders:
                    info = self._start(gpus, settings, timeout)
                    log.info("mpsrun: started this node's MPS daemons (%s)", self.root)
                info["holders"] = [*holders, _me()]
                self._write(info)
                return info
        except filelock.Timeout:
            raise DaemonTimeoutError(f"--per-node: this node's session was not ready within {timeout:g} s") from None

    def leave(self) -> bool:
        """Unregister; the last live holder stops the daemons and removes everything. True if it did."""
        with self.lock:
            info = self._read() or {}
            me = _me()
            holders = [h for h in info.get("holders", []) if _alive(h) and h["pid"] != me["pid"]]
            if holders:
                info["holders"] = holders
                self._write(info)
                return False
            self._teardown(info)
            with contextlib.suppress(OSError):
                os.unlink(self.lock.lock_file)  # nothing may be left behind on the node
            return True


def run_per_node(config: Any, environ: Mapping[str, str] | None = None) -> JobResult:
    """Run ``config.command`` as this process's rank, sharing the node's MPS session."""
    env = dict(os.environ if environ is None else environ)
    find_control_executable()
    visible = gpu_info.visible_gpus(env)
    chosen = gpu_info.select_gpus(list(config.gpus) if config.gpus is not None else None, visible)
    local, position = local_placement(env, len(chosen), config.map_by)
    session = NodeSession(base_directory(env), job_key(env), env.get("MPSRUN_NODE_ID") or socket.gethostname())
    percentage = config.thread_percentage
    if percentage == "auto":  # 100 divided by the local ranks sharing each GPU, when the launcher says how many
        size = mpi.first_int(env, _LOCAL_SIZE_VARIABLES)
        percentage = max(1, 100 * len(chosen) // size) if size else None
    elif not isinstance(percentage, int):
        percentage = None
    settings = {"thread_percentage": percentage, "mem_limit": config.mem_limit}
    info = session.join(chosen, settings, timeout=60.0)
    try:
        daemon = info["daemons"][position]
        rank_env = {
            **env,
            "CUDA_VISIBLE_DEVICES": daemon["gpu"],
            "CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_dir"],
            "CUDA_MPS_LOG_DIRECTORY": daemon["log_dir"],
            "MPSRUN_SESSION_DIR": str(session.root),
            "LOCAL_RANK": str(local),
        }
        rank_env.update(client_variables(percentage, config.mem_limit, config.priority))
        rank = int(env.get("SLURM_PROCID") or mpi.first_int(env, mpi.RANK_VARIABLES) or local)
        rank_env.setdefault("RANK", str(rank))
        supervisor = Supervisor(
            [RankSpec(rank, list(config.command), rank_env)],
            tag_output=config.tag_output,
            grace=config.grace,
            timeout=config.timeout,
        )
        watcher = ControlDaemon(
            gpu_uuid=daemon["gpu"],
            pipe_dir=Path(daemon["pipe_dir"]),
            log_dir=Path(daemon["log_dir"]),
            executable=find_control_executable(),
        )
        verified: set[int] = set()

        def check() -> str | None:
            pids = {p.pid for p in supervisor.procs.values()}
            for proc in list(supervisor.procs.values()):
                with contextlib.suppress(psutil.Error):
                    pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
            with contextlib.suppress(MPSError):
                clients, strays = watcher.judge_clients(pids)
                verified.update(clients)
                if strays:
                    message = f"rank {rank} (pid {min(strays)}) uses GPU {position} without MPS"
                    if config.mps == "on":
                        return message
                    log.warning(f"mpsrun: warning: {message}")
            return None

        supervisor.check = check
        result = supervisor.run()
        log.info(f"mpsrun: rank {rank} {'verified' if verified else 'not seen'} as an MPS client")
        if result.exit_code != 0:
            print(f"mpsrun: {result.message}", file=sys.stderr, flush=True)
        return result
    finally:
        if session.leave():
            log.info("mpsrun: last local rank out: stopped this node's MPS daemons")
