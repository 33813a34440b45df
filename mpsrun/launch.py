"""Running a job: plan the ranks, start the MPS session, run a backend, report, tear down.

The CLI builds a :class:`JobConfig` and calls :func:`run_job`; nothing here parses
command lines or exits the interpreter.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import psutil

from mpsrun import mpi
from mpsrun.daemon import diagnose_log, torn_down_clients
from mpsrun.errors import CommandNotFoundError, ConfigError, DaemonError, GPUError, TeardownError
from mpsrun.placement import RankPlan, ThreadSpec, plan_ranks, rank_environments
from mpsrun.session import Session
from mpsrun.supervisor import JobResult, RankSpec, Supervisor

__all__ = [
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_SETUP",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "LAUNCHERS",
    "JobConfig",
    "run_job",
]

log = logging.getLogger("mpsrun")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SETUP = 3
EXIT_TIMEOUT = 124
EXIT_NOT_FOUND = 127
LAUNCHERS = ("auto", "local", "mpiexec")


@attrs.frozen
class JobConfig:
    """Everything that defines one ``mpsrun`` job (validated by :func:`run_job`)."""

    command: tuple[str, ...]
    nranks: int = 1
    gpus: tuple[int | str, ...] | None = None  # None: every visible GPU
    map_by: str = "block"
    thread_percentage: ThreadSpec = None
    mem_limit: str | None = None
    priority: int | None = None
    mps: str = "auto"
    launcher: str = "auto"
    mpiexec: str | None = None
    mpiexec_args: tuple[str, ...] = ()
    tag_output: bool = False
    timeout: float | None = None
    grace: float = 5.0
    keep_logs: bool = False
    verbose: bool = False
    per_node: bool = False
    hosts: tuple[str, ...] = ()
    hostfile: str | None = None


def choose_launcher(config: JobConfig) -> tuple[str, str | None]:
    """(``local`` or ``mpiexec``, path of mpiexec). ``auto`` takes mpiexec when it and mpi4py exist."""
    if config.launcher not in LAUNCHERS:
        raise ConfigError(
            f"--launcher must be one of {', '.join(LAUNCHERS)}, not {config.launcher!r}", setting="--launcher"
        )
    if config.launcher == "local":
        return "local", None
    found = mpi.find_mpiexec(config.mpiexec)
    if config.launcher == "mpiexec":
        if found is None:
            raise ConfigError("--launcher mpiexec: no mpiexec or mpirun on PATH", setting="--launcher")
        return "mpiexec", found
    if found is not None and (config.mpiexec or mpi.mpi4py_available()):
        return "mpiexec", found
    return "local", None


def resolve_command(command: Sequence[str]) -> str:
    if not command:
        raise ConfigError("no command to run: mpsrun [options] [--] command [args...]", setting="command")
    program = shutil.which(command[0])
    if program is None:
        raise CommandNotFoundError(f"{command[0]}: command not found", command=command[0])
    return program


class ClientWatch:
    """Finds ranks that use the GPU without being clients of our server (CUDA's silent fallback).

    ``rank_pids`` returns {pid: rank} for the ranks' processes; their descendants count
    as the same rank. A rank is reported after two checks in a row see it off MPS.
    """

    def __init__(self, session: Session, rank_pids: Callable[[], dict[int, int]], required: bool) -> None:
        self.session = session
        self.rank_pids = rank_pids
        self.required = required
        self.verified: set[int] = set()
        self.seen: dict[int, int] = {}  # every rank pid (and descendant) seen: pid -> rank
        self._suspects: dict[int, int] = {}
        self._warned: set[int] = set()

    def _with_descendants(self) -> dict[int, int]:
        result: dict[int, int] = {}
        for pid, rank in self.rank_pids().items():
            result[pid] = rank
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(pid).children(recursive=True):
                    result.setdefault(child.pid, rank)
        return result

    def check(self) -> str | None:
        pids = self._with_descendants()
        self.seen.update(pids)
        strays: list[str] = []
        for position, (gpu, daemon) in enumerate(zip(self.session.gpus, self.session.daemons, strict=True)):
            if not daemon.alive:
                tail = daemon.log_tail(5)
                return f"the MPS control daemon of GPU {gpu.index} died under the job" + (
                    f"; its log ends: {tail.splitlines()[-1]}" if tail else ""
                )
            try:
                clients, missed = daemon.judge_clients(pids)
            except (DaemonError, GPUError) as exc:
                log.debug("client check skipped: %s", exc)
                continue
            self.verified.update(pids[pid] for pid in clients)
            for pid, rank in sorted(pids.items()):
                if pid not in missed:
                    self._suspects.pop(pid, None)
                    continue
                self._suspects[pid] = self._suspects.get(pid, 0) + 1
                if self._suspects[pid] >= 2 and rank not in self._warned:
                    strays.append(f"rank {rank} (pid {pid}) uses GPU {position} without MPS")
                    self._warned.add(rank)
        if not strays:
            return None
        message = (
            "; ".join(strays) + ": not a client of this job's MPS server (CUDA silently runs without MPS when it "
            "cannot reach the daemon; does the rank change CUDA_MPS_PIPE_DIRECTORY?)"
        )
        if self.required:
            return message
        log.warning(f"mpsrun: warning: {message}")
        return None


def _ranges(values: Sequence[int]) -> str:
    parts: list[str] = []
    for value in sorted(values):
        if parts and parts[-1].split("-")[-1] == str(value - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{value}"
        else:
            parts.append(str(value))
    return ",".join(parts) or "none"


#: Clients an MPS server accepts on Volta and later (documented; the H100 with driver 580
#: logged "Maximum number of clients (48) reached" for the 49th).
MPS_CLIENT_LIMIT = 48


def _report_mps_failure(session: Session, rank_of: dict[int, int], note: Callable[[str], None]) -> None:
    """Say what the MPS logs tell about a failed job; the log tail when a daemon died."""
    for daemon in session.daemons:
        try:
            text = daemon.log_file.read_text(errors="replace")
        except OSError:
            continue
        for finding in diagnose_log(text):
            note(finding)
        victims = [rank_of[pid] for pid in torn_down_clients(text) if pid in rank_of]
        if victims:
            note(
                f"rank(s) {_ranges(sorted(set(victims)))} were torn down by the MPS server after the fatal GPU fault "
                "(MPS does not say which client caused it; the first rank to fail is reported above)"
            )
        if not daemon.alive:
            note(f"the MPS control daemon stopped; its log ({daemon.log_file}) ends:\n{daemon.log_tail(10)}")


class Job:
    """One run of a :class:`JobConfig`; see :func:`run_job`."""

    def __init__(self, config: JobConfig, note: Callable[[str], None] | None = None) -> None:
        self.started = time.monotonic()
        self.config = config
        self.note = note or (lambda text: print(f"mpsrun: {text}", file=sys.stderr, flush=True))

    def _describe_plan(self, plan: Sequence[RankPlan], session: Session) -> None:
        for entry in plan:
            gpu = session.gpus[entry.gpu].index if session.gpus else "-"
            log.info(
                f"mpsrun: rank {entry.rank}: GPU {gpu}"
                + (f", {entry.thread_percentage}% of SMs" if entry.thread_percentage else "")
                + (f", {entry.mem_limit} pinned memory" if entry.mem_limit else "")
            )

    def run(self) -> JobResult:
        config = self.config
        self.program = resolve_command(config.command)
        if config.hosts or config.hostfile:
            return self._run_multi_host()
        backend, mpiexec = choose_launcher(config)
        session = Session(
            gpus=list(config.gpus) if config.gpus is not None else "all",
            mem_limit=config.mem_limit,
            mps=config.mps,
            keep_logs=config.keep_logs,
            export=False,
        )
        session.resolve()
        plan = plan_ranks(
            config.nranks,
            max(1, len(session.gpus)),
            config.map_by,
            config.thread_percentage,
            config.mem_limit,
            config.priority,
        )
        crowded = {gpu: n for gpu, n in Counter(p.gpu for p in plan).items() if n > MPS_CLIENT_LIMIT}
        for gpu, n in crowded.items():
            if session.mps != "off" and session.disabled_reason is None:
                log.warning(
                    f"mpsrun: warning: {n} ranks share GPU {gpu}, but an MPS server accepts at most "
                    f"{MPS_CLIENT_LIMIT} clients on Volta and later GPUs; use more GPUs or fewer ranks"
                )
        percentages = [p.thread_percentage for p in plan if p.thread_percentage is not None]
        if percentages and len(percentages) == len(plan):
            session.thread_percentage = max(percentages)  # the daemon's cap; ranks tighten it
        result: JobResult | None = None
        flavour = None
        if backend == "mpiexec":  # asked while the daemons start: `mpiexec --version` takes a while
            assert mpiexec is not None
            flavour = concurrent.futures.ThreadPoolExecutor(1).submit(mpi.detect_flavour, mpiexec)
        session.start(wait_active=False)  # daemons answer; servers come up while the ranks start
        log.info(f"mpsrun: daemons ready after {time.monotonic() - self.started:.3f} s")
        try:
            gpu_envs = [session.env(i) for i in range(len(session.gpus))] or [{}]
            envs = rank_environments(plan, gpu_envs)
            log.info(f"mpsrun: {backend} launcher, MPS {'on' if session.enabled else 'off'}, {config.nranks} rank(s)")
            self._describe_plan(plan, session)
            job_dir = Path(tempfile.mkdtemp(prefix="mpsrun-job-"))
            try:
                result, watch = self._run_backend(backend, mpiexec, flavour, session, envs, job_dir)
            finally:
                shutil.rmtree(job_dir, ignore_errors=True)
            if watch is not None:
                verified = sorted(watch.verified)
                log.info(
                    f"mpsrun: {len(verified)} of {config.nranks} rank(s) verified as MPS clients ({_ranges(verified)})"
                )
            if result.exit_code != 0:
                self.note(result.message)
                if session.enabled:
                    _report_mps_failure(session, watch.seen if watch is not None else {}, self.note)
        finally:
            try:
                session.close()
                log.info(f"mpsrun: torn down after {time.monotonic() - self.started:.3f} s")
            except TeardownError as exc:  # reported, never hiding the job's own outcome
                self.note(str(exc))
                if result is not None and result.exit_code == EXIT_OK:
                    result = JobResult(EXIT_SETUP, "teardown-failed", str(exc))
        assert result is not None
        return result

    def _run_multi_host(self) -> JobResult:
        """mpiexec over the hosts, each rank through ``mpsrun --per-node``: one MPS session per host."""
        config = self.config
        if config.launcher == "local":
            raise ConfigError("--hosts/--hostfile need the mpiexec launcher", setting="--launcher")
        if isinstance(config.thread_percentage, list):
            raise ConfigError(
                "--hosts: per-rank percentage lists are not supported; give one value or auto",
                setting="--thread-percentage",
            )
        mpiexec = mpi.find_mpiexec(config.mpiexec)
        if mpiexec is None:
            raise ConfigError("--hosts/--hostfile: no mpiexec or mpirun on PATH", setting="--hosts")
        flavour = mpi.detect_flavour(mpiexec)
        forwarded = ["--per-node", "--mps", config.mps, "--map-by", config.map_by, "--grace", str(config.grace)]
        if config.gpus is not None:
            forwarded += ["--gpus", ",".join(map(str, config.gpus))]
        for option, value in (
            ("--thread-percentage", config.thread_percentage),
            ("--mem-limit", config.mem_limit),
            ("--priority", config.priority),
        ):
            if value is not None:
                forwarded += [option, str(value)]
        if config.verbose:
            forwarded.append("-v")
        argv = mpi.mpiexec_command(
            mpiexec,
            flavour,
            config.nranks,
            [sys.executable, "-m", "mpsrun", *forwarded, "--", self.program, *config.command[1:]],
            [*mpi.host_arguments(flavour, config.hosts, config.hostfile), *config.mpiexec_args],
            cores=psutil.cpu_count(logical=False),
            tag_output=config.tag_output,
        )
        log.info(f"mpsrun: {flavour} mpiexec over hosts: {' '.join(argv)}")
        result = Supervisor(
            [RankSpec(0, argv, dict(os.environ))], grace=config.grace, timeout=config.timeout, note=self.note
        ).run()
        if result.cause == "rank-failed" and result.first_failure is not None:
            result.message = f"mpiexec {result.first_failure.describe().split(') ', 1)[1]}"
            self.note(result.message)
        return result

    def _run_backend(
        self,
        backend: str,
        mpiexec: str | None,
        flavour_future: concurrent.futures.Future[str] | None,
        session: Session,
        envs: list[dict[str, str]],
        job_dir: Path,
    ) -> tuple[JobResult, ClientWatch | None]:
        config = self.config
        base_env = dict(os.environ)
        if backend == "local":
            specs = [RankSpec(rank, config.command, {**base_env, **env}) for rank, env in enumerate(envs)]
        else:
            assert mpiexec is not None
            plan_file = job_dir / "plan.json"
            plan_file.write_text(json.dumps({"ranks": envs}))
            ranks_dir = job_dir / "ranks"
            ranks_dir.mkdir()
            flavour = flavour_future.result() if flavour_future is not None else mpi.detect_flavour(mpiexec)
            argv = mpi.mpiexec_command(
                mpiexec,
                flavour,
                config.nranks,
                # The program by absolute path: Open MPI puts its own bin directory first on the
                # ranks' PATH, so "python3" could name another interpreter there.
                [sys.executable, "-m", "mpsrun.rank", "--", self.program, *config.command[1:]],
                config.mpiexec_args,
                cores=psutil.cpu_count(logical=False),
                tag_output=config.tag_output,
            )
            log.info(f"mpsrun: {flavour} mpiexec: {' '.join(argv)}")
            env = {**base_env, "MPSRUN_PLAN": str(plan_file), "MPSRUN_RANKS_DIR": str(ranks_dir)}
            specs = [RankSpec(0, argv, env)]
        supervisor = Supervisor(
            specs,
            tag_output=config.tag_output and backend == "local",
            grace=config.grace,
            timeout=config.timeout,
            before_stop=session.detach_clients if session.enabled else None,
            after_start=session.wait_active if session.enabled else None,
            note=self.note,
        )
        watch = None
        if session.enabled:
            if backend == "local":
                rank_pids: Callable[[], dict[int, int]] = lambda: {p.pid: r for r, p in supervisor.procs.items()}  # noqa: E731
            else:
                rank_pids = lambda: _read_rank_pids(job_dir / "ranks")  # noqa: E731
            watch = ClientWatch(session, rank_pids, required=config.mps == "on")
            supervisor.check = watch.check
        log.info(f"mpsrun: starting ranks after {time.monotonic() - self.started:.3f} s")
        result = supervisor.run()
        if watch is not None:
            watch.seen.update(rank_pids())  # ranks that ended before any check, for the failure summary
        log.info(f"mpsrun: ranks done after {time.monotonic() - self.started:.3f} s")
        if backend == "mpiexec" and result.cause == "rank-failed" and result.first_failure is not None:
            result.message = f"mpiexec {result.first_failure.describe().split(') ', 1)[1]}"
        return result, watch


def _read_rank_pids(directory: Path) -> dict[int, int]:
    found: dict[int, int] = {}
    for entry in directory.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            found[int(entry.read_text())] = int(entry.stem)
    return found


def run_job(config: JobConfig, note: Callable[[str], None] | None = None) -> JobResult:
    """Run a job to completion and return how it ended (exit code, cause, message).

    Raises :class:`ConfigError` (usage, exit 2), :class:`CommandNotFoundError` (127) or
    another :class:`MPSError` (set-up failure, exit 3) before any rank starts.
    """
    return Job(config, note).run()
