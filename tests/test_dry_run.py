"""``mpsrun --dry-run``: the plan, printed, with nothing started (issue 36, D).

Open MPI users check a job's layout with ``--display-map``; a batch script is best checked on the login node, which
has no GPU. The plan's variables come from the code a running job uses, so they are what the ranks would get.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import MPSRUN

SIM = ["python", "sim.py"]  # never run: a dry run starts nothing


def dry(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MPSRUN, "--dry-run", *options, *SIM], capture_output=True, text=True, timeout=120)


def ranks_of(out: str) -> dict[int, tuple[str, dict[str, str]]]:
    """Each rank's line (its GPU and limits) and variables, with the variables every rank shares added."""
    lines = out.splitlines()
    common = dict(word.split("=", 1) for word in lines[-2].removeprefix("every rank: ").split())
    found = {}
    for head, variables in itertools.pairwise(lines):
        if match := re.fullmatch(r"rank (\d+): (.*)", head):
            found[int(match.group(1))] = (match.group(2), {**common, **dict(w.split("=", 1) for w in variables.split())})
    return found


def test_the_plan_without_a_gpu(no_gpu):
    """On a machine with no driver (a login node), the plan of 8 ranks on GPUs 0 and 1 with --thread-percentage auto:
    ranks 0-3 on GPU 0, 4-7 on GPU 1, 25% each, and the variables each rank gets; exit 0, nothing started."""
    out = dry("-np", "8", "--gpus", "0,1", "--thread-percentage", "auto")
    assert out.returncode == 0, out.stderr
    ranks = ranks_of(out.stdout)
    assert [ranks[r][0] for r in range(8)] == [f"GPU {r // 4}, 25% of SMs" for r in range(8)], out.stdout
    assert ranks[5][1]["RANK"] == "5" and ranks[5][1]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert ranks[5][1]["CUDA_VISIBLE_DEVICES"] == "<uuid-of-GPU-1>" and ranks[5][1]["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert out.stdout.splitlines()[-1].startswith("nothing was started (dry run)")
    assert not list(no_gpu.iterdir()) or all(p.name != "mpsrun-0" for p in no_gpu.iterdir())


DUMP = "import json, os, sys; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(json.dumps(dict(os.environ)))"


def test_the_plan_is_what_a_job_gives(fake_gpu, short_tmp, monkeypatch):
    """With a GPU, the plan names the GPU's UUID and gives each rank the variables a running job gives it: the same
    names, and the same values but for the session's paths and the rendezvous port, which a job makes as it starts."""
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_FILE", "CUDA_LOG_FILE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    options = ["-np", "4", "--launcher", "local", "--mem-limit", "auto"]
    out = subprocess.run([*MPSRUN, "--dry-run", *options, *SIM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    planned = ranks_of(out.stdout)
    job = subprocess.run([*MPSRUN, *options, sys.executable, "-c", DUMP, str(short_tmp)], capture_output=True,
                         text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    for rank in range(4):
        real = json.loads((short_tmp / str(rank)).read_text())
        given = {k: v for k, v in real.items() if os.environ.get(k) != v}  # what mpsrun set or changed
        plan = planned[rank][1]
        assert set(given) == set(plan), set(given) ^ set(plan)
        session = real["MPSRUN_SESSION_DIR"]
        for name, value in plan.items():
            if name != "MASTER_PORT":
                assert given[name] == value.replace("<session>", session), name
    assert fake_gpu.uuids[0] in out.stdout and "rank 0: GPU 0, " in out.stdout


@pytest.mark.parametrize("fake_gpu", [8], indirect=True)
def test_the_plan_calls_each_gpu_by_its_index(fake_gpu, short_tmp):
    """``--gpus 0,7`` on 8 GPUs: the plan calls the second GPU 7 (its UUID's), in its header, rank 1's line and its
    daemon's directory, as the running job does (rank 1's pipe is ``gpu7/pipe``); MPSRUN_GPU stays the rank's GPU
    among the job's, as the header says. The plan called it GPU 1, with gpu1/pipe, beside GPU 7's UUID."""
    options = ["-np", "2", "--launcher", "local", "--gpus", "0,7"]
    out = subprocess.run([*MPSRUN, "--dry-run", *options, *SIM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"GPU 7 (MPSRUN_GPU=1): {fake_gpu.uuids[7]}," in out.stdout, out.stdout
    planned = ranks_of(out.stdout)
    assert planned[1][0] == "GPU 7" and planned[1][1]["CUDA_MPS_PIPE_DIRECTORY"] == "<session>/gpu7/pipe", out.stdout
    assert planned[1][1]["MPSRUN_GPU"] == "1" and planned[1][1]["CUDA_VISIBLE_DEVICES"] == fake_gpu.uuids[7]
    job = subprocess.run([*MPSRUN, *options, sys.executable, "-c", DUMP, str(short_tmp)], capture_output=True,
                         text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    real = json.loads((short_tmp / "1").read_text())
    assert real["CUDA_MPS_PIPE_DIRECTORY"].endswith("/gpu7/pipe") and real["MPSRUN_GPU"] == "1"


def test_the_plan_without_a_gpu_names_the_gpus_given(no_gpu):
    """Without a driver, ``--gpus 0,7`` is GPUs 0 and 7 in the plan (rank 1: GPU 7, ``gpu7/pipe``)."""
    out = dry("-np", "2", "--gpus", "0,7")
    assert out.returncode == 0, out.stderr
    planned = ranks_of(out.stdout)
    assert planned[1][0] == "GPU 7" and planned[1][1]["CUDA_MPS_PIPE_DIRECTORY"] == "<session>/gpu7/pipe", out.stdout


@pytest.mark.parametrize("options", [["--per-node"], ["--hosts", "localhost"]])
def test_a_dry_run_of_several_nodes_is_refused(no_gpu, options):
    """A dry run plans a job of this host; with --per-node or --hosts it says so in one line, exit 2."""
    out = dry(*options)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--dry-run plans a job of this host" in out.stderr
