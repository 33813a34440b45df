"""Check ``mpsrun tune`` on a workload whose answer is known: tune it, then run the recommended command three
times and compare its throughput with the one tune predicted (GPU machine).

    python benchmarks/tune_check.py OUT.json [--ranks 1,2,4,8] [--repeats 3] [--budget S] [--scaling weak|strong]
                                    -- command [args...]

OUT.json holds tune's own JSON (``mpsrun tune --json``) and a ``reproduced`` entry: the three runs' seconds and
throughputs, and their median over the predicted median. ``mpsrun.tuning.report`` prints its table again:
``python benchmarks/tune_check.py --report OUT.json [--plot FILE.png]``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mpsrun import tune
from mpsrun.runtime.output import say
from mpsrun.tuning import TuneResult
from mpsrun.tuning.report import format_report, plot


def reproduce(result: TuneResult, runs: int = 3) -> dict[str, object]:
    """Run the recommended command ``runs`` times; its throughputs beside the prediction."""
    chosen = result.recommended
    assert chosen is not None, "nothing was measured"
    argv = [sys.executable, "-m", "mpsrun", *shlex.split(result.job.command_line(chosen.setting))[1:]]
    seconds = []
    for _ in range(runs):
        start = time.monotonic()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.monotonic() - start)
    per_job = chosen.setting.ranks if result.job.scaling == "weak" else 1
    throughputs = [per_job / s for s in seconds]
    return {"command": result.job.command_line(chosen.setting), "seconds": seconds, "throughputs": throughputs,
            "predicted": chosen.median, "ratio": statistics.median(throughputs) / chosen.median}


def main() -> None:
    if sys.argv[1:2] == ["--report"]:
        data = json.loads(Path(sys.argv[2]).read_text())
        result = TuneResult.from_json(data)
        print(format_report(result, max(len(t.runs) for t in result.trials)))
        print(f"reproduced: {json.dumps(data.get('reproduced'))}")
        if "--plot" in sys.argv:
            plot(result, sys.argv[sys.argv.index("--plot") + 1])
        return
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--repeats", default="3")
    parser.add_argument("--budget")
    parser.add_argument("--scaling", default="weak")
    args = parser.parse_args(sys.argv[1:split])
    result = tune(sys.argv[split + 1:], ranks=args.ranks, repeats=args.repeats, budget=args.budget,
                  scaling=args.scaling, progress=say)
    print(format_report(result, int(args.repeats)), flush=True)
    data = {**result.to_json(), "reproduced": reproduce(result)}
    print(f"reproduced: {json.dumps(data['reproduced'])}", flush=True)
    Path(args.out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
