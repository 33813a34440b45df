"""What a job pays for mpsrun: start-up and teardown against MPS by hand and bare mpiexec.

    python benchmarks/overhead.py [--repeats 3] [--seed 13] [--json FILE] [--only trivial|real] [--variants A,B]

Two jobs, each run every way side by side, in alternating repeats (each round runs every
variant once, in an order drawn from ``--seed``):

- trivial: ``-np 4 python3 -c pass`` (and ``-np 48``, ``--trivial-ranks``): nothing but start-up and teardown;
- real: 8 ranks, each 200 launches of an 8-block kernel (about 1.7 s of GPU work per rank).

Variants:

- ``script``: MPS started by a shell script (benchmarks/mps_by_script.sh), as a site's wrapper does it: its own
  directories, ``nvidia-cuda-mps-control -d``, poll until it answers, start the ranks, wait, ``quit``, wait for the
  daemon to exit, remove the directories; ``script+mpiexec``: the same with the ranks started by bare ``mpiexec``.
  The references of mpsrun's start-up: they pay for a shell, as mpsrun pays for an interpreter;
- ``hand``: the same steps from this process (no shell, no interpreter to start: a floor, not a reference);
- ``hand+mpiexec``: the same, with the ranks started by bare ``mpiexec`` (how a wrapper runs an
  MPI job; the reference for ``mpsrun --launcher mpiexec``);
- ``script+mpiexec+least supervisor``: ``script+mpiexec`` with every rank started under
  benchmarks/least_supervisor.py (an interpreter without ``site`` that imports what a supervisor speaking JSON over
  a socket needs, starts the rank and waits for it): what a supervisor interpreter per rank adds to MPS by script;
- ``bare mpiexec``: ``mpiexec -n N`` without MPS; ``bare mpiexec+least supervisor``: each rank under the least
  supervisor, and ``... +mpsrun's imports`` under it with what mpsrun's supervisor imports (where the time goes);
- ``least command``, ``least command -S``: benchmarks/least_command.py, the least Python command that starts MPS
  and, meanwhile, ``mpiexec`` with every rank under the least supervisor (with and without ``site``): the floor of
  ``mpsrun --launcher mpiexec`` in the same rounds;
- ``torchrun``: ``torchrun --standalone --nproc-per-node N`` of the same program (no MPS), where it is installed;
- ``mpsrun local``, ``mpsrun local --mps off``, ``mpsrun mpiexec``: the ``mpsrun`` command; ``mpsrun mpiexec
  --mps off`` and ``--mpi4py-abort off`` (Python ranks started as given, not through mpi4py's runner) tell what
  MPS and that runner add.

``--tree NAME=DIR`` (repeatable) adds ``mpsrun local [NAME]`` and ``mpsrun mpiexec [NAME]``: the same
command run from another source tree (another commit's ``mpsrun/`` under DIR), in the same rounds,
so two versions are compared on the same machine state.

Each figure is the wall time of the whole job, measured from this process. Nothing here is a
pass/fail test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from least_command import gone  # (benchmarks/, this script's directory, is first on the path)

from mpsrun.job.mpiexec import detect_flavour
from mpsrun.tools.benchwork import BLOCKS, KERNEL, THREADS

REPO = Path(__file__).resolve().parent.parent
# Self-contained (the kernel's source inline): the same command runs under every tree compared with --tree.
KERNEL_JOB = [sys.executable, "-c", (
    f"import sys; import cupy; KERNEL, BLOCKS, THREADS = {KERNEL!r}, {BLOCKS}, {THREADS}; "
    "k = cupy.RawKernel(KERNEL, 'fma_loop'); out = cupy.empty(BLOCKS * THREADS, dtype=cupy.float32); "
    "[k((BLOCKS,), (THREADS,), (out, cupy.int32(int(sys.argv[1])))) for _ in range(int(sys.argv[2]))]; "
    "cupy.cuda.Device().synchronize()")]
CONTROL = "nvidia-cuda-mps-control"


def mpiexec_argv(n: int) -> list[str]:
    """Bare mpiexec for ``n`` local ranks (Open MPI as root, and with more ranks than cores, needs its flags, as
    mpsrun adds them)."""
    mpiexec = shutil.which("mpiexec") or "mpiexec"
    openmpi = detect_flavour(mpiexec) == "openmpi"
    extra = ["--allow-run-as-root"] if openmpi and os.geteuid() == 0 else []
    if openmpi and n > (psutil.cpu_count(logical=False) or 1):  # as mpsrun adds it: more ranks than cores
        extra.append("--oversubscribe")
    return [mpiexec, *extra, "-n", str(n)]


def control(env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True, env=env, check=False)


def hand(ranks: Callable[[dict[str, str]], None]) -> None:
    """MPS by hand around ``ranks``: what a wrapper script does, step by step."""
    root = Path(tempfile.mkdtemp(prefix="mps-hand-"))
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    try:
        (root / "pipe").mkdir()
        (root / "log").mkdir()
        subprocess.run([CONTROL, "-d"], env=env, check=True)
        deadline = time.monotonic() + 10
        while control(env, "get_server_list").returncode != 0:  # poll until the daemon answers
            if time.monotonic() > deadline:
                raise RuntimeError("the hand-started daemon did not answer within 10 s")
            time.sleep(0.002)
        ranks(env)
    finally:  # also when the daemon could not start: nothing of it is left
        control(env, "quit")  # (with no daemon, the control program only fails to reach one)
        pid_file = root / "pipe" / "nvidia-cuda-mps-control.pid"
        if pid_file.exists():
            wait_gone(int(pid_file.read_text()), 10.0)
        shutil.rmtree(root)


def wait_gone(pid: int, seconds: float) -> None:
    """Until ``pid`` has exited (:func:`least_command.gone`: a daemonized process may stay a zombie)."""
    deadline = time.monotonic() + seconds
    while not gone(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the hand-started daemon {pid} did not exit within {seconds:g} s")
        time.sleep(0.002)


def local_ranks(n: int, command: list[str]) -> Callable[[dict[str, str]], None]:
    def run(env: dict[str, str]) -> None:
        procs = [subprocess.Popen(command, env={**env, "RANK": str(i), "WORLD_SIZE": str(n)}) for i in range(n)]
        if any(p.wait() for p in procs):
            raise RuntimeError(f"a rank failed: {command}")
    return run


def mpiexec_ranks(n: int, command: list[str]) -> Callable[[dict[str, str]], None]:
    def run(env: dict[str, str]) -> None:
        subprocess.run([*mpiexec_argv(n), *command], env=env, check=True)
    return run


SCRIPT = REPO / "benchmarks" / "mps_by_script.sh"


def by_script(how: str) -> Callable[[int, list[str]], Callable[[], None]]:
    """MPS started by the shell script around ``n`` ranks, started by it (``local``) or by bare mpiexec."""
    def variant(n: int, command: list[str]) -> Callable[[], None]:
        mpiexec = mpiexec_argv(n)
        env = {**os.environ, "MPIEXEC": mpiexec[0], "MPIEXEC_FLAGS": " ".join(mpiexec[1:-2])}
        return lambda: subprocess.run(["bash", str(SCRIPT), str(n), how, *command], env=env, check=True) and None
    return variant


LEAST_SUPERVISOR = [sys.executable, "-S", str(REPO / "benchmarks" / "least_supervisor.py")]


def least_command(*flags: str) -> Callable[[int, list[str]], Callable[[], None]]:
    """benchmarks/least_command.py around ``n`` ranks (``flags``: the interpreter's)."""
    def variant(n: int, command: list[str]) -> Callable[[], None]:
        argv = [sys.executable, *flags, str(REPO / "benchmarks" / "least_command.py"), *mpiexec_argv(n), "--", *command]
        return lambda: subprocess.run(argv, check=True) and None
    return variant


def torchrun(n: int, command: list[str]) -> Callable[[], None]:
    """torchrun's launch of ``n`` copies of a Python ``command`` (``python -c CODE``), from a file of that code."""
    program = Path(tempfile.mkdtemp(prefix="mpsrun-torchrun-")) / "rank.py"
    atexit.register(shutil.rmtree, program.parent, ignore_errors=True)
    program.write_text(command[-1] + "\n")
    argv = ["torchrun", "--standalone", f"--nproc-per-node={n}", str(program)]
    return lambda: subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) and None


def console_script() -> str:
    """The ``mpsrun`` command as pip writes it on install (this tree may be run from source, uninstalled)."""
    bin_dir = tempfile.mkdtemp(prefix="mpsrun-bin-")
    atexit.register(shutil.rmtree, bin_dir, ignore_errors=True)
    path = Path(bin_dir) / "mpsrun"
    path.write_text(f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
                    "from mpsrun._entry import main\nif __name__ == '__main__':\n"
                    "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    path.chmod(0o755)
    return str(path)


MPSRUN = console_script()


def mpsrun(*args: str, tree: str | None = None) -> Callable[[int, list[str]], Callable[[], None]]:
    """The ``mpsrun`` command with ``args``; from the source tree ``tree`` instead of this one if given."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != REPO]])}

    def variant(n: int, command: list[str]) -> Callable[[], None]:
        argv = [MPSRUN, "-np", str(n), *args, "--", *command]
        return lambda: subprocess.run(argv, check=True, env=env) and None
    return variant


VARIANTS: dict[str, Callable[[int, list[str]], Callable[[], None]]] = {
    "script": by_script("local"),
    "script+mpiexec": by_script("mpiexec"),
    "script+mpiexec+least supervisor": lambda n, cmd: by_script("mpiexec")(n, [*LEAST_SUPERVISOR, *cmd]),
    "hand": lambda n, cmd: lambda: hand(local_ranks(n, cmd)),
    "hand+mpiexec": lambda n, cmd: lambda: hand(mpiexec_ranks(n, cmd)),
    "bare mpiexec": lambda n, cmd: lambda: mpiexec_ranks(n, cmd)(dict(os.environ)),
    "bare mpiexec+least supervisor": lambda n, cmd: lambda: mpiexec_ranks(n, [*LEAST_SUPERVISOR, *cmd])(
        dict(os.environ)),
    "bare mpiexec+least supervisor+mpsrun's imports": lambda n, cmd: lambda: mpiexec_ranks(
        n, [*LEAST_SUPERVISOR, "--import", "mpsrun.rank.cli", *cmd])(dict(os.environ)),
    "mpsrun local": mpsrun("--launcher", "local"),
    "mpsrun local --mps off": mpsrun("--launcher", "local", "--mps", "off"),
    "mpsrun mpiexec": mpsrun("--launcher", "mpiexec"),
    "mpsrun mpiexec --mps off": mpsrun("--launcher", "mpiexec", "--mps", "off"),
    "mpsrun mpiexec --mpi4py-abort off": mpsrun("--launcher", "mpiexec", "--mpi4py-abort", "off"),
    "least command": least_command(),
    "least command -S": least_command("-S"),
}
if shutil.which("torchrun"):
    VARIANTS["torchrun"] = torchrun
REFERENCE = {"mpsrun local": "script", "mpsrun mpiexec": "bare mpiexec", "mpsrun local --mps off": "script",
             "script+mpiexec": "bare mpiexec", "script+mpiexec+least supervisor": "bare mpiexec",
             "bare mpiexec+least supervisor": "bare mpiexec", "bare mpiexec+least supervisor+mpsrun's imports":
             "bare mpiexec", "mpsrun mpiexec --mps off": "bare mpiexec", "mpsrun mpiexec --mpi4py-abort off":
             "bare mpiexec", "least command": "bare mpiexec", "least command -S": "bare mpiexec"}
REAL_REFERENCE = {"mpsrun local": "script", "mpsrun mpiexec": "script+mpiexec"}


def measure(jobs: dict[str, Callable[[], None]], repeats: int, rng: random.Random) -> dict[str, list[float]]:
    """Wall seconds of each job, ``repeats`` rounds; each round runs every job once, in a shuffled order."""
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(repeats):
        for name in rng.sample(list(jobs), len(jobs)):
            start = time.perf_counter()
            jobs[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def calibrate(ms: float) -> int:
    out = subprocess.run([sys.executable, "-m", "mpsrun.tools.benchwork", "--calibrate", str(ms)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[-1])


def table(title: str, samples: dict[str, list[float]], reference: dict[str, str], ratio: bool) -> str:
    lines = [f"{title}", f"| what | median | min-max | against | {'ratio' if ratio else 'difference'} |",
             "|---|---:|---:|---|---:|"]
    med = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        ref = reference.get(name)
        versus = "" if ref is None else (f"{med[name] / med[ref]:.3f}x" if ratio
                                          else f"{(med[name] - med[ref]) * 1000:+.0f} ms")
        lines.append(f"| {name} | {med[name]:.3f} s | {min(values):.3f}-{max(values):.3f} s | {ref or ''} | {versus} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=("trivial", "real"))
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--trivial-ranks", default="4,48", help="rank counts of the trivial job (4,48)")
    parser.add_argument("--variants", help="only these variants of the trivial job, comma-separated (default: all)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="also run mpsrun from the source tree DIR, as variants named [NAME]")
    args = parser.parse_args()
    for name, _, tree in (item.partition("=") for item in args.tree):
        for launcher, reference in (("local", "script"), ("mpiexec", "bare mpiexec")):
            VARIANTS[f"mpsrun {launcher} [{name}]"] = mpsrun("--launcher", launcher, tree=str(Path(tree).resolve()))
            REFERENCE[f"mpsrun {launcher} [{name}]"] = reference
            REAL_REFERENCE[f"mpsrun {launcher} [{name}]"] = "script" if launcher == "local" else "script+mpiexec"
    # Bytecode as installed packages have it (pip compiles on install): a source tree may not have it yet, and a
    # machine may forbid writing it (PYTHONDONTWRITEBYTECODE; the GPU machine does), which would make every
    # process compile its imports again. The warm-up round writes what is missing.
    # pynvml too, the one module from outside the standard library that a job imports: without its bytecode
    # every job compiles it again, and that holds the interpreter's lock while the job starts.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    for tree in [REPO, *(Path(item.partition("=")[2]) for item in args.tree)]:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "mpsrun")], check=True,
                       stdout=subprocess.DEVNULL)
    nvml = importlib.util.find_spec("pynvml")
    if nvml and nvml.origin and subprocess.run([sys.executable, "-m", "compileall", "-q", nvml.origin]).returncode:
        print(f"note: could not write the bytecode of {nvml.origin}: every job compiles it", flush=True)
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible order, not a secret
    results: dict[str, object] = {"repeats": args.repeats, "seed": args.seed}
    for n in (int(part) for part in args.trivial_ranks.split(",")) if args.only != "real" else ():
        chosen = args.variants.split(",") if args.variants else list(VARIANTS)
        trivial = {name: VARIANTS[name](n, [sys.executable, "-c", "pass"]) for name in chosen}
        measure(trivial, 1, rng)  # warm-up: page cache, not counted
        results["trivial" if n == 4 else f"trivial-{n}"] = samples = measure(trivial, args.repeats, rng)
        print(table(f"Trivial job, -np {n} python3 -c pass", samples, REFERENCE, ratio=False), flush=True)
    if args.only != "trivial":
        iters = calibrate(8.5)
        command = [*KERNEL_JOB, str(iters), str(args.launches)]
        launched = [name for name in VARIANTS if name.startswith("mpsrun") and " off" not in name]
        names = ["script", "script+mpiexec", "hand", "hand+mpiexec", *launched]
        real = {name: VARIANTS[name](8, command) for name in names}
        measure(real, 1, rng)  # warm-up: CuPy's kernel cache, not counted
        results["real"] = samples = measure(real, args.repeats, rng)
        results["iters"] = iters
        print(table(f"\n8 ranks x {args.launches} launches of an 8-block kernel ({iters} iterations per thread)",
                    samples, REAL_REFERENCE, ratio=True), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
