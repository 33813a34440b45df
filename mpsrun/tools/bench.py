"""``mpsrun bench``: how much MPS gains on this GPU, measured side by side.

For each rank count N it times the same small-kernel work three ways:

* **time-sliced**: N ranks under ``mpsrun --mps off`` (what plain ``mpirun`` gives);
* **MPS**: N ranks under ``mpsrun`` (a private MPS daemon);
* **one process**: the same N kernel streams issued by ONE process on N CUDA streams, the
  hardware's own reference for "all of them at once".

Each rank warms up first (kernel compilation, first launch) and all start together at a
time the driver sets once every rank is ready, so process start-up and exit are not
counted. Each figure is the median of several repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpsrun.config.commandline import OneLineParser
from mpsrun.errors import MPSError, NoDriverError
from mpsrun.exitcodes import ExitCode
from mpsrun.mps import gpus as gpu_info
from mpsrun.mps.daemon import unavailable_reason
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import own_module
from mpsrun.tools.plotting import pyplot

__all__ = ["BenchRow", "main", "measure", "run_bench"]

MODES = ("timesliced", "mps", "reference")
_WORKER = own_module("mpsrun.tools.benchwork")


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One rank count: median seconds per mode, and the ratios people ask for."""

    ranks: int
    seconds: dict[str, float]
    samples: dict[str, list[float]]

    @property
    def speedup(self) -> float:
        """Time-sliced time over MPS time (higher is better)."""
        return self.seconds["timesliced"] / self.seconds["mps"]

    @property
    def efficiency(self) -> float:
        """One-process reference time over MPS time (1.0: MPS runs the ranks as one process would)."""
        return self.seconds["reference"] / self.seconds["mps"]


def _mpsrun(ranks: int, mps: str, worker: Sequence[str]) -> list[str]:
    # One GPU: the comparison is N ranks sharing a GPU.
    return [
        *own_module("mpsrun.cli"),
        "-q",
        "-np",
        str(ranks),
        "--gpus",
        "0",
        "--launcher",
        "local",
        "--mps",
        mps,
        *worker,
    ]


def measure(
    mode: str,
    ranks: int,
    iters: int,
    launches: int,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    command: Sequence[str] | None = None,
) -> float:
    """Seconds from the common start until the last rank's kernels are done.

    ``command`` (optional) runs the ranks some other way; it gets the worker's argv
    appended and must start ``ranks`` processes (the study uses it for hand-started MPS).
    """
    with tempfile.TemporaryDirectory(prefix="mpsrun-bench-") as tmp:
        sync = Path(tmp)
        worker = [*_WORKER, "--sync", str(sync), "--iters", str(iters), "--launches", str(launches)]
        if mode == "reference":
            argv, expected = [*worker, "--streams", str(ranks)], 1
        elif command is not None:
            argv, expected = [*command, *worker], ranks
        else:
            argv, expected = _mpsrun(ranks, "off" if mode == "timesliced" else "on", worker), ranks
        proc = subprocess.Popen(
            argv, env=dict(env or os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + timeout
            while len(list(sync.glob("ready.*"))) < expected:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise MPSError(f"bench {mode} N={ranks}: ranks did not get ready: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
                time.sleep(0.01)
            go_at = time.time() + 0.2
            (sync / "go.tmp").write_text(repr(go_at))
            (sync / "go.tmp").replace(sync / "go")
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise MPSError(f"bench {mode} N={ranks} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
        results = [json.loads(p.read_text()) for p in sync.glob("result.*.json")]
        if len(results) != expected or not all(r["ok"] for r in results):
            raise MPSError(f"bench {mode} N={ranks}: {len(results)} of {expected} results, or a wrong result")
        return float(max(r["end"] for r in results)) - go_at


def calibrate(target_ms: float) -> int:
    out = subprocess.run([*_WORKER, "--calibrate", str(target_ms)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise MPSError(f"bench: calibration failed: {out.stderr.strip()[-2000:]}")
    return int(out.stdout.split()[-1])


def run_bench(
    ranks: Sequence[int],
    repeats: int = 3,
    kernel_ms: float = 8.0,
    launches: int = 20,
    progress: bool = True,
) -> tuple[list[BenchRow], dict[str, object]]:
    """Measure every rank count in every mode; returns the rows and what was run where."""

    def say(text: str) -> None:
        if progress:
            print(f"bench: {text}", file=sys.stderr, flush=True)

    say(f"calibrating a {kernel_ms:g} ms kernel")
    iters = calibrate(kernel_ms)
    say(f"{iters} iterations per thread; warming up")
    measure("reference", max(ranks), iters, launches)  # clocks up, caches warm; not counted
    rows = []
    for n in ranks:
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(repeats):
            for mode in MODES:
                seconds = measure(mode, n, iters, launches)
                samples[mode].append(seconds)
                say(f"N={n} {mode} {repeat + 1}/{repeats}: {seconds:.3f} s")
        rows.append(BenchRow(n, {m: statistics.median(s) for m, s in samples.items()}, samples))
    gpu = gpu_info.visible_gpus()[0]
    driver = gpu_info.driver_info()
    meta: dict[str, object] = {
        "gpu": gpu.name,
        "driver": driver.driver_version,
        "cuda": driver.cuda_version,
        "kernel": f"{8} blocks x 256 threads, {iters} dependent FMAs per thread (~{kernel_ms:g} ms alone)",
        "launches_per_rank": launches,
        "repeats": repeats,
        "cpu_cores": os.cpu_count(),
    }
    return rows, meta


def format_table(rows: Sequence[BenchRow], meta: Mapping[str, object]) -> str:
    lines = [
        f"GPU: {meta['gpu']} (driver {meta['driver']}, CUDA {meta['cuda']}); kernel: {meta['kernel']}; "
        f"{meta['launches_per_rank']} launches per rank; median of {meta['repeats']}",
        f"{'ranks':>5}  {'time-sliced':>11}  {'MPS':>8}  {'one process':>11}  {'speedup':>7}  {'efficiency':>10}",
    ]
    for row in rows:
        s = row.seconds
        lines.append(
            f"{row.ranks:>5}  {s['timesliced']:>10.3f}s  {s['mps']:>7.3f}s  {s['reference']:>10.3f}s  "
            f"{row.speedup:>6.2f}x  {row.efficiency:>10.2f}"
        )
    lines.append("speedup = time-sliced / MPS; efficiency = one process / MPS (1.00 = as good as one process)")
    return "\n".join(lines)


def plot(rows: Sequence[BenchRow], path: str) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    x = [row.ranks for row in rows]
    for mode, label in (("timesliced", "time-sliced"), ("mps", "MPS (mpsrun)"), ("reference", "one process")):
        axis.plot(x, [row.seconds[mode] for row in rows], marker="o", label=label)
    axis.set_xlabel("ranks on one GPU")
    axis.set_ylabel("seconds (median)")
    axis.set_xscale("log", base=2)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a positive whole number (``int``) or a positive finite number (``float``)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < 1e9:
            what = "whole number" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"must be a positive {what}, not {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _rank_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a list of positive integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a list of positive integers, not {text!r}")
    return values


def _check_prerequisites() -> None:
    """Refuses, in one line, what cannot run the benchmark: no GPU, no CuPy, or no MPS."""
    try:
        visible = gpu_info.visible_gpus()
    except NoDriverError as exc:
        raise MPSError(f"bench needs an NVIDIA GPU: {exc.message}") from None
    if not visible:
        raise MPSError("bench needs an NVIDIA GPU: none is visible (check CUDA_VISIBLE_DEVICES)")
    if importlib.util.find_spec("cupy") is None:
        raise MPSError("bench needs CuPy for its kernels: pip install 'mpsrun[cuda12]' or 'mpsrun[cuda13]'")
    reason = unavailable_reason("auto")
    if reason is not None:
        raise MPSError(f"bench compares MPS with time-slicing, but MPS cannot run here: {reason}")


def main(argv: Sequence[str]) -> int:
    parser = OneLineParser(prog="mpsrun bench", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     epilog="It needs an NVIDIA GPU, MPS and CuPy.")
    parser.add_argument("--ranks", type=_rank_list, default=[1, 2, 4, 8, 16], help="rank counts (1,2,4,8,16)")
    parser.add_argument("--repeats", type=_positive(int), default=3, help="repeats per figure; the median is shown (3)")
    parser.add_argument("--kernel-ms", type=_positive(float), default=8.0, help="one kernel's time when alone (8)")
    parser.add_argument("--launches", type=_positive(int), default=20, help="kernel launches per rank (20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the figure (needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        _check_prerequisites()
        rows, meta = run_bench(args.ranks, args.repeats, args.kernel_ms, args.launches)
        if args.plot:
            plot(rows, args.plot)
    except MPSError as exc:
        say(f"mpsrun bench: error: {exc}")
        if args.json:  # a script reading stdout learns why, too
            print(json.dumps({"error": str(exc)}))
        return exc.exit_code
    if args.json:
        payload = {
            "meta": meta,
            "rows": [
                {
                    "ranks": r.ranks,
                    "seconds": r.seconds,
                    "samples": r.samples,
                    "speedup": r.speedup,
                    "efficiency": r.efficiency,
                }
                for r in rows
            ],
        }
        print(json.dumps(payload, indent=1))
    else:
        print(format_table(rows, meta))
    return ExitCode.OK
