"""Each rank's device memory, sampled from NVML while a job runs: its peak, and the samples for a report.

NVML gives each process's device memory on a GPU (an MPS client's allocations and its context, as it does
for a plain CUDA process); a rank's figure is the sum over its processes (the rank's own and its
descendants', which are the same rank) and its GPUs. A rank that ends before the first sample has none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from mpsrun.errors import GPUError
from mpsrun.mps import gpus as gpu_info

__all__ = ["SAMPLES_KEPT", "Sample", "UsageSampler"]

log = logging.getLogger("mpsrun")

#: The most samples a job keeps for its report: beyond it every other one is dropped (and the interval doubles),
#: so a job of days reports its whole course in a bounded file.
SAMPLES_KEPT = 4096


class Sample(NamedTuple):
    """The ranks' device memory (MiB) at one moment (``time``: seconds since the epoch)."""

    time: float
    memory: dict[int, int]


class UsageSampler:
    """Samples the device memory of a job's ranks on these GPUs (``uuids``); ``keep``: keep the samples too."""

    def __init__(self, uuids: Sequence[str], keep: bool = False) -> None:
        self.uuids = list(uuids)
        self.keep = keep
        self.peaks: dict[int, int] = {}  # rank -> MiB
        self.samples: list[Sample] = []
        self._every = 1  # keep one sample in this many (doubles each time the kept ones are thinned)
        self._taken = 0

    def sample(self, pids: Mapping[int, int]) -> bool:
        """One look: ``pids`` maps every process of the ranks (descendants too) to its rank. Whether a peak grew."""
        used: dict[int, int] = {}
        try:
            for uuid in self.uuids:
                for pid, memory in gpu_info.process_memory(uuid).items():
                    if pid in pids:
                        used[pids[pid]] = used.get(pids[pid], 0) + memory
        except GPUError as exc:  # NVML cannot say now: no sample
            log.debug("memory sample skipped: %s", exc)
            return False
        mib = {rank: memory >> 20 for rank, memory in used.items()}
        grew = [rank for rank, memory in mib.items() if memory > self.peaks.get(rank, -1)]
        self.peaks.update({rank: mib[rank] for rank in grew})
        self._keep(mib)
        return bool(grew)

    def _keep(self, mib: dict[int, int]) -> None:
        self._taken += 1
        if not self.keep or (self._taken - 1) % self._every:
            return
        self.samples.append(Sample(round(time.time(), 3), mib))
        if len(self.samples) > SAMPLES_KEPT:
            self.samples = self.samples[::2]
            self._every *= 2
