"""Whole commands timed in alternating rounds: each round runs every command once, in an order drawn from a seed, so
that no command always runs on a machine the one before it warmed (or left busy). Used by benchmarks/farm.py and
benchmarks/executor.py."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def timed_rounds(runs: Mapping[str, Sequence[str]], repeats: int, seed: int, cwd: Path) -> dict[str, list[float]]:
    """Each command's wall seconds, one figure a round (its output dropped; a command that fails stops it all)."""
    order = random.Random(seed)  # noqa: S311 - an order of runs, not a secret
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats):
        names = list(runs)
        order.shuffle(names)
        for name in names:
            start = time.monotonic()
            subprocess.run(list(runs[name]), check=True, cwd=cwd, stdout=subprocess.DEVNULL)
            seconds[name].append(round(time.monotonic() - start, 3))
            print(f"round {round_ + 1}: {name}: {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return seconds


def report(seconds: Mapping[str, list[float]], settings: Mapping[str, object], json_path: str | None) -> None:
    """Each command's median and spread; with ``json_path`` the figures and ``settings`` there too."""
    for name, figures in seconds.items():
        print(f"{name:<36} median {statistics.median(figures):8.2f} s  min {min(figures):8.2f}  max "
              f"{max(figures):8.2f}")
    if json_path:
        Path(json_path).write_text(json.dumps({"args": dict(settings), "seconds": dict(seconds)}, indent=1))
