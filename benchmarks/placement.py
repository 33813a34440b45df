"""How long planning one node's ranks takes: the node's plan and every rank's welcome, as a controller makes them.

    python benchmarks/placement.py [--ranks 1000 10000] [--gpus 8] [--rounds 5]

For each rank count, two settings: plain (a GPU each by --map-by block), and --thread-percentage auto with
--mem-limit auto (each GPU's share worked out per node). Each round makes the node's plan once and then one
welcome per rank, as the launcher's controller does when every rank says hello. Pure CPU work, no GPU needed;
prints the median and the spread of the rounds. The figures go to docs/benchmarks.md ("Planning a node").
"""

from __future__ import annotations

import argparse
import statistics
import time

from mpsrun.agent.welcome import welcome
from mpsrun.config.options import JobConfig
from mpsrun.mps.environment import GpuTarget
from mpsrun.mps.placement import NodePlan
from mpsrun.rank.identity import RankIdentity

SETTINGS = {"plain": {}, "auto": {"thread_percentage": "auto", "mem_limit": "auto"}}


def one_round(ranks: int, gpus: int, fields: dict[str, str]) -> float:
    """Seconds to plan ``ranks`` ranks on ``gpus`` GPUs and welcome each."""
    config = JobConfig(command=("true",), nranks=ranks, mps="on", **fields)
    targets = [GpuTarget(f"GPU-{i}", f"/tmp/pipe{i}", f"/tmp/log{i}", "/tmp/session", 1, 132) for i in range(gpus)]
    free = [ranks * (2 << 30)] * gpus  # room for an auto share of 1 GiB or more per rank
    start = time.perf_counter()
    node = NodePlan.make(config, gpus, ranks, free)
    for rank in range(ranks):
        welcome(RankIdentity(rank, rank, ranks, ranks), node, targets.__getitem__, True, "/tmp/session")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"| ranks | setting | ms (median of {args.rounds}) | min-max |")
    print("|---|---|---|---|")
    for ranks in args.ranks:
        for name, fields in SETTINGS.items():
            times = [one_round(ranks, args.gpus, fields) * 1000 for _ in range(args.rounds)]
            print(f"| {ranks:,} | {name} | {statistics.median(times):.0f} | {min(times):.0f}-{max(times):.0f} |")


if __name__ == "__main__":
    main()
