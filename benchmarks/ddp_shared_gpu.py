"""DDP training with several ranks on one GPU: NCCL under MPS against gloo, time-slicing and one process (issue 35).

    python benchmarks/ddp_shared_gpu.py [--rounds 5] [--ranks 4] [--nccl LIBNCCL] [--json FILE]

Every setting runs ``examples/ddp_train.py`` (a 512-1024-1024-10 MLP, 256 samples a rank a step, 300 timed steps
after 20 of warm-up) as one mpsrun job on GPU 0, in each round in a new order. Throughput is the samples a second of
all ranks together. ``--nccl``: a libnccl.so.2 of 2.30 or later, preloaded in the ranks (torch ships 2.28, which
refuses several ranks on one GPU); the settings that need it are left out without one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py")
#: name -> (mpsrun options, ranks or None for --ranks, whether it needs NCCL 2.30+)
SETTINGS = {
    "one process alone": (["--mps", "off"], 1, False),
    "NCCL under MPS (mpsrun's cap)": (["--mps", "on"], None, True),
    "NCCL under MPS, NCCL_MAX_CTAS=2": (["--mps", "on", "-x", "NCCL_MAX_CTAS=2"], None, True),
    "gloo under MPS": (["--mps", "on"], None, False),
    "NCCL time-sliced (--mps off)": (["--mps", "off"], None, True),
}


def run(name: str, ranks: int, nccl: str | None) -> dict[str, object]:
    options, count, _ = SETTINGS[name]
    count = count or ranks
    backend = "gloo" if "gloo" in name else "nccl"
    preload = ["-x", f"LD_PRELOAD={nccl}"] if nccl and count > 1 and backend == "nccl" else []
    argv = [sys.executable, "-m", "mpsrun", "-np", str(count), "--launcher", "local", "--gpus", "0",
            "--local-rank", "device", "--timeout", "600", *options, *preload, sys.executable, TRAIN,
            "--backend", backend]
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=700)
    wall = time.perf_counter() - start
    found = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    ok = out.returncode == 0 and len(found) == count and all(r["replicas_equal"] for r in found)
    return {"setting": name, "ranks": count, "exit": out.returncode, "ok": ok, "wall_s": round(wall, 2),
            "samples_per_s": round(sum(r["samples_per_s"] for r in found), 1) if ok else None,
            "error": "" if ok else out.stderr.strip().splitlines()[-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nccl", help="a libnccl.so.2 of NCCL 2.30 or later, to preload in the ranks")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    names = [name for name, (_, _, needs) in SETTINGS.items() if args.nccl or not needs]
    runs = []
    for round_number in range(args.rounds):
        order = random.Random(round_number).sample(names, len(names))  # noqa: S311 - an order, not a secret
        for name in order:
            runs.append(result := run(name, args.ranks, args.nccl))
            print(f"round {round_number + 1}: {name}: {result['samples_per_s']} samples/s "
                  f"(exit {result['exit']}){' ' + str(result['error']) if result['error'] else ''}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(f"\n{'setting':34} {'ranks':>5} {'samples/s median':>17} {'min - max':>21} {'vs one process':>14}")
    alone = statistics.median(r["samples_per_s"] for r in runs if r["setting"] == "one process alone" and r["ok"])
    for name in names:
        rates = sorted(r["samples_per_s"] for r in runs if r["setting"] == name and r["ok"])
        if not rates:
            print(f"{name:34} failed in every round")
            continue
        ranks = next(r["ranks"] for r in runs if r["setting"] == name)
        median = statistics.median(rates)
        print(f"{name:34} {ranks:5} {median:17,.0f} {rates[0]:10,.0f} - {rates[-1]:<10,.0f} {median / alone:13.2f}x"
              f"{'' if len(rates) == args.rounds else f'  ({args.rounds - len(rates)} failed)'}")


if __name__ == "__main__":
    main()
