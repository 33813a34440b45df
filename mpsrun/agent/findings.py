"""What a job's end says beyond its first failure: MPS log findings and the proof of MPS.

Used by the command and by node keepers alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

from mpsrun.agent.outcome import ranges
from mpsrun.config.values import mib_text
from mpsrun.errors import MPSError
from mpsrun.mps import gpus
from mpsrun.mps.daemon import ControlDaemon
from mpsrun.mps.limits import memory_hint
from mpsrun.mps.placement import RankPlan
from mpsrun.mps.replies import diagnose_log, torn_down_clients
from mpsrun.mps.watch import RankWatch
from mpsrun.runtime.constants import MPS_CLIENT_LIMIT
from mpsrun.runtime.files import read_log
from mpsrun.session.session import Session

__all__ = ["MPS_CLIENT_LIMIT", "crowding_warnings", "mps_report", "placement_line", "shared_memory_hint",
           "verified_line"]



def mps_report(daemons: Sequence[ControlDaemon], rank_of: Mapping[int, int]) -> list[str]:
    """What the MPS logs tell about a failed job (a daemon that died is the watch's finding, on every path)."""
    lines: list[str] = []
    for daemon in daemons:
        try:
            text = read_log(daemon.log_file, start=0).decode(errors="replace")
        except OSError:
            continue
        lines += diagnose_log(text)
        victims = sorted({rank_of[pid] for pid in torn_down_clients(text) if pid in rank_of})
        if victims:
            lines.append(
                f"rank(s) {ranges(victims)} were torn down by the MPS server after the fatal GPU fault "
                "(MPS does not say which client caused it; the first rank to fail is reported above)"
            )
    return lines


def placement_line(session: Session, plan: RankPlan) -> str:
    """Where a rank runs and with what limits, for -v."""
    if not session.gpus:
        return "no GPU"
    if session.gpu_bind == "none":
        where = "GPUs " + ",".join(str(g.index) for g in session.gpus)
    else:
        where = f"GPU {session.gpus[plan.gpu].index}"
    auto = " (auto)" if plan.mem_auto else ""
    return where + (f", {plan.thread_percentage}% of SMs" if plan.thread_percentage else "") + (
        f", {mib_text(plan.mem_limit)} pinned memory{auto}" if plan.mem_limit else "")


def verified_line(watch: RankWatch, ranks: Iterable[int], where: str = "") -> str:
    """Per rank: connected to MPS, used the GPU WITHOUT MPS, or no CUDA context seen."""
    ranks = sorted(ranks)
    connected = sorted(watch.verified.intersection(ranks))
    without = sorted(watch.without_mps.intersection(ranks) - watch.verified)
    unseen = sorted(set(ranks) - watch.verified - watch.without_mps)
    noun = "rank" if len(ranks) == 1 else "ranks"
    line = f"{where}{len(connected)} of {len(ranks)} {noun} connected to MPS"
    if connected and (without or unseen):
        line += f" ({ranges(connected)})"
    if without:
        line += f"; used the GPU WITHOUT MPS: rank(s) {ranges(without)}"
    if unseen:
        line += f"; no CUDA context seen: rank(s) {ranges(unseen)}"
    return line


def crowding_warnings(per_gpu: Mapping[int, int], what: str = "ranks") -> list[str]:
    """A warning for each GPU that ``what`` (ranks, a farm's slots, an executor's workers) would crowd past what its
    MPS server takes."""
    return [
        f"warning: {n} {what} share GPU {gpu}, but an MPS server accepts at most {MPS_CLIENT_LIMIT} clients on "
        f"Volta and later GPUs; use more GPUs or fewer {what}"
        for gpu, n in sorted(per_gpu.items())
        if n > MPS_CLIENT_LIMIT
    ]


def shared_memory_hint(session: Session | None, position: int, sharers: int) -> str:
    """Whether a failed rank's GPU (``position`` in the session), shared with ``sharers - 1`` others and no memory
    limit, was short of memory as it ended (NVML); "" without MPS, where no limit could have helped."""
    if session is None or not session.enabled:
        return ""
    gpu = session.gpus[position]
    with contextlib.suppress(MPSError):
        return memory_hint(gpu.index, gpus.memory_free(gpu.uuid), gpu.memory_total, sharers)
    return ""
