"""GPU tier: farms (``mpsrun --tasks`` / ``--array``) with the real MPS daemon and CuPy tasks.

Every task of a farm is a proven MPS client of the farm's daemon; one task's illegal address, which MPS answers by
tearing down every client with work in flight, costs the others nothing (they run again alone and succeed) and is
recorded against the task that caused it.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

#: Tasks of the proof farm (the issue's 200; MPSRUN_GPU_FARM_TASKS for a shorter run by hand).
FARM_TASKS = int(os.environ.get("MPSRUN_GPU_FARM_TASKS", "200"))

SMALL = "import cupy; x = cupy.ones(1 << 16, dtype=cupy.float32); print(float((x * 2).sum()))"

FAULTING = (
    "import os, sys, time, pathlib, cupy\n"
    "d = pathlib.Path(sys.argv[1]); t = int(os.environ['MPSRUN_TASK_ID'])\n"
    "x = cupy.ones(1 << 16, dtype=cupy.float32); cupy.cuda.Device().synchronize()\n"
    "(d / f'ran.{t}.{os.getpid()}').touch()\n"
    "if t == 7:\n"  # the culprit: once the 7 others are clients with work in flight (or alone, at once)
    "    end = time.monotonic() + 60\n"
    "    while len({p.name.split('.')[1] for p in d.glob('ran.*')} - {'7'}) < 7 and time.monotonic() < end:\n"
    "        time.sleep(0.05)\n"
    "    time.sleep(0.5)\n"
    "    (d / 'faulted').touch()\n"
    "    k = cupy.RawKernel(r'extern \"C\" __global__ void bad(int* p) { p[threadIdx.x] = 1; }', 'bad')\n"
    "    k((1,), (32,), (cupy.int64(16),)); cupy.cuda.Device().synchronize()\n"
    "end = time.monotonic() + (0.2 if (d / 'faulted').exists() else 60)\n"
    "while time.monotonic() < end:\n"
    "    x = x * 1.0000001\n"
    "    cupy.cuda.Device().synchronize()\n"
)


def farm(tmp_path, *args):
    """Run a farm to its end (in the cupy_job fixture's environment): its exit code, stderr and results lines."""
    out = tmp_path / "r.jsonl"
    run = subprocess.run([sys.executable, "-m", "mpsrun", "--mps", "on", "--results", str(out), *args],
                         capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return run.returncode, run.stderr, lines


def test_a_farm_of_cupy_tasks_every_one_a_proven_mps_client(cupy_job, tmp_path):
    """FARM_TASKS CuPy tasks on one GPU with 8 slots: every task succeeds once, and every one is proven a client of
    the farm's MPS server (the server's own log names it)."""
    code, err, lines = farm(tmp_path, "-np", "8", "--gpus", "0", "--array", f"0-{FARM_TASKS - 1}",
                            sys.executable, "-c", SMALL)
    assert code == 0, err
    assert sorted(line["id"] for line in lines) == list(range(FARM_TASKS))
    assert [line["id"] for line in lines if line["mps"] is not True] == [], err
    assert {line["slot"] for line in lines} == set(range(8))


def test_an_illegal_address_costs_only_its_own_task(cupy_job, tmp_path):
    """8 slots, 8 tasks: task 7 makes an illegal address while the 7 others run kernels. MPS tears them all down;
    the 7 run again alone and succeed (one try each: a fault's victims are not counted), task 7 faults again alone
    and is recorded as the fault's, named on stderr, and the farm exits with its code."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "faulting.py"
    script.write_text(FAULTING)
    code, err, lines = farm(tmp_path, "-np", "8", "--gpus", "0", "--array", "0-7", sys.executable, str(script),
                            str(marks))
    by_id = {line["id"]: line for line in lines}
    assert sorted(by_id) == list(range(8)), err
    assert all(by_id[t]["cause"] == "ok" and by_id[t]["tries"] == 1 for t in range(7)), (lines, err)
    assert by_id[7]["cause"] == "fault" and code == by_id[7]["exit_code"] != 0, (lines, err)
    assert "task 7 caused a fatal GPU fault" in err, err
    print(err[-3000:])


def test_an_executors_four_workers_are_proven_mps_clients(cupy_job):
    """mpsrun.Executor with 4 workers on GPU 0 (MPS on): every worker runs CuPy calls and is proven a client of the
    executor's MPS server; the results are right."""
    import executor_calls

    import mpsrun

    with mpsrun.Executor(workers=4, gpus="0", mps="on") as executor:
        sums = list(executor.map(executor_calls.cupy_sum, range(16)))
        accounts = executor.accounts()
    assert sums == [float(x * (1 << 16)) for x in range(16)]
    assert [a.mps for a in accounts] == [True] * 4, accounts


def test_an_illegal_address_fails_only_the_executors_call_that_made_it(cupy_job, tmp_path):
    """mpsrun.Executor, 4 workers on GPU 0: call 3 makes an illegal address while calls 0-2 run kernels. The others
    run again alone and succeed; call 3's future fails with its CUDA error, noted as the fault's own."""
    import executor_calls

    import mpsrun

    marks = tmp_path / "marks"
    marks.mkdir()
    with mpsrun.Executor(workers=4, gpus="0", mps="on") as executor:
        futures = [executor.submit(executor_calls.cupy_until_fault, str(marks), call == 3, 3) for call in range(4)]
        done = [f.exception(timeout=300) for f in futures]
    assert done[:3] == [None, None, None], done
    assert done[3] is not None and "caused a fatal GPU fault" in "".join(getattr(done[3], "__notes__", [])), done[3]
