"""``mpsrun --dry-run``: the job's plan, printed, with nothing started (no daemon, no rank, no directory).

Each rank's variables come from the same :func:`mpsrun.agent.welcome.welcome` a running job uses, so what is printed
is what the ranks would get, with the session's paths and the rendezvous port written as placeholders. Without a
driver (a login node checking a batch script) the GPUs are the positions ``--gpus`` names, and what depends on them
(their UUIDs, free memory for ``--mem-limit auto``, their SMs for NCCL's cap) is said to be read when the job starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

from mpsrun.agent.welcome import mpi4py_abort, mpi4py_available, rendezvous, welcome
from mpsrun.config.options import JobConfig
from mpsrun.config.values import mib_text
from mpsrun.errors import ConfigError, MPSError, NoDriverError
from mpsrun.exitcodes import ExitCode
from mpsrun.job.mpiexec import find_mpiexec
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import unavailable_reason
from mpsrun.mps.environment import GpuTarget
from mpsrun.mps.placement import NodePlan, slot_environment
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.output import one_line, say

__all__ = ["plan_lines", "show"]

#: What a job makes as it starts, in the plan's variables (single words: one variable a word).
SESSION, PORT, CAP = "<session>", "<free-port>", "<from-SMs>"
PLACEHOLDERS = (f"{SESSION}: the job's private directory; {PORT}: a port free as it starts; {CAP}: half a rank's share "
                "of its GPU's SMs, read as it starts")


def _gpus(config: JobConfig) -> tuple[list[gpu_info.GPU], str]:
    """The job's GPUs as the driver lists them, or none with why (no driver here)."""
    try:
        return gpu_info.select_gpus(config.gpus, gpu_info.visible_gpus()), ""
    except NoDriverError as exc:
        return [], exc.message


def _names(config: JobConfig, found: Sequence[gpu_info.GPU], count: int) -> list[str]:
    """What each GPU position is called, as a running job calls it (``-v``, its ``gpuN`` directory): the GPU's index,
    or without a driver what ``--gpus`` gave (``--gpus 0,7``: GPUs 0 and 7, not 0 and 1)."""
    return [str(gpu.index) for gpu in found] or [str(g) for g in (config.gpus or range(count))]


def _targets(config: JobConfig, found: Sequence[gpu_info.GPU], count: int) -> list[GpuTarget]:
    """How each GPU position would be reached: its UUID (or what names it, without a driver) and daemon paths."""
    named = [gpu.uuid for gpu in found] or [f"<uuid-of-GPU-{g}>" for g in (config.gpus or range(count))]
    names = _names(config, found, count)
    sms = [gpu.multiprocessors for gpu in found] or [None] * count
    groups = [list(range(count))] if config.gpu_bind == "none" else [[position] for position in range(count)]
    targets = []
    for group in groups:
        visible = ",".join(str(named[p]) for p in group)
        counts = [sms[p] for p in group]
        least = None if None in counts else min(c for c in counts if c is not None)
        pipe = None if config.mps == "off" else f"{SESSION}/gpu{names[group[0]]}"
        targets.append(GpuTarget(visible, pipe and f"{pipe}/pipe", pipe and f"{pipe}/log",
                                 None if pipe is None else SESSION, len(group), least))
    return targets


def plan_lines(config: JobConfig) -> list[str]:
    """What the job would do, for the terminal: its GPUs and MPS, then each rank's place, limits and variables."""
    if config.per_node or config.hosts or config.hostfile:
        raise ConfigError("--dry-run plans a job of this host: give it without --per-node, --hosts or --hostfile "
                          "(each node's ranks get the plan of their place on that node)", setting="--dry-run")
    found, why = _gpus(config)
    count = len(found) or len(config.gpus or (0,))
    node = NodePlan.make(config, count, config.ranks, [g.memory_free for g in found], config.ranks)
    plans = node.ranks(config.ranks)
    targets = _targets(config, found, count)
    lines = _header(config, found, why, count)
    names = _names(config, found, count)
    noun = "slot" if config.farm else "rank"
    envs = [slot_environment(targets[0 if config.gpu_bind == "none" else plan.gpu], plan, config.queues)
            if config.farm else _variables(node, plan.rank, targets) for plan in plans]
    common = {k: v for k, v in envs[0].items() if all(env.get(k) == v for env in envs[1:])}
    for plan, env in zip(plans, envs, strict=True):
        limits = [f"{plan.thread_percentage}% of SMs" if plan.thread_percentage else "",
                  f"{mib_text(plan.mem_limit)} pinned memory" if plan.mem_limit else
                  "its share of the GPU's free memory, read when the job starts" if plan.mem_auto else ""]
        where = "every job GPU" if config.gpu_bind == "none" else f"GPU {names[plan.gpu]}"
        lines.append(f"{noun} {plan.rank}: {where}" + "".join(f", {part}" for part in limits if part))
        if own := [f"{k}={v}" for k, v in sorted(env.items()) if k not in common]:
            lines.append("  " + " ".join(own))
    lines.append(f"every {noun}: " + " ".join(f"{k}={v}" for k, v in sorted(common.items())))
    lines.append(f"nothing was started (dry run); {PLACEHOLDERS}")
    return lines


def _header(config: JobConfig, found: Sequence[gpu_info.GPU], why: str, count: int) -> list[str]:
    launcher = config.launcher if config.launcher != "auto" else \
        "mpiexec" if find_mpiexec(config.mpiexec) and mpi4py_available() else "local"
    cannot = unavailable_reason(config.mps) or why
    mps = "off" if config.mps == "off" else config.mps + (
        f"; this host cannot run it ({cannot}), so below is the plan where it can" if cannot else "")
    what = f"a farm of {config.ranks} slot(s)" if config.farm else \
        f"{config.ranks} rank(s) of {' '.join(config.command)}, launcher {launcher}"
    lines = [f"mpsrun --dry-run: {what} on {socket.gethostname()}, MPS {mps}"]
    if found:
        lines += [f"GPU {g.index} (MPSRUN_GPU={p}): {g.uuid}, {g.name}, {g.multiprocessors or '?'} SMs, "
                  f"{g.memory_free / 2**30:.1f} GiB free" for p, g in enumerate(found)]
    else:
        lines.append(f"GPUs: {count} ({why or 'none listed'}); their UUIDs, free memory and SMs are read when the "
                     "job starts")
    return lines


def _variables(node: NodePlan, rank: int, targets: Sequence[GpuTarget]) -> dict[str, str]:
    """What mpsrun gives ``rank``: its welcome's variables and the defaults the caller's environment leaves."""
    config = node.config
    identity = RankIdentity(rank, rank, config.ranks, config.ranks)
    abort = mpi4py_abort(config.mpi4py_abort)
    given, _ = welcome(identity, node, lambda p: targets[0 if config.gpu_bind == "none" else p], abort,
                       session_dir=SESSION)
    env = dict(given.env)
    for group in given.defaults:
        if not any(name in os.environ for name in group):  # the caller's values win, as in a running job
            env.update(group)
    env.update(rendezvous("127.0.0.1", 0, os.environ))
    if "MASTER_PORT" in env:
        env["MASTER_PORT"] = PORT
    if "NCCL_MAX_CTAS" in env and targets[0].multiprocessors is None and "NCCL_MAX_CTAS" not in os.environ:
        env["NCCL_MAX_CTAS"] = CAP
    return env


def show(config: JobConfig, more: Callable[[], list[str]] | None = None) -> int:
    """Print the plan (and ``more`` of it before its last line: a farm's tasks); 0, or what refused it."""
    try:
        lines = plan_lines(config)
        extra = more() if more is not None else []
    except MPSError as exc:
        say(f"mpsrun: error: {exc}")
        return exc.exit_code
    print("\n".join(map(one_line, [*lines[:-1], *extra, lines[-1]])))
    return ExitCode.OK
