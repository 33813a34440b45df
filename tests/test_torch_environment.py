"""PyTorch's launcher conventions (issue 35): torchrun's whole environment, NCCL on a shared GPU, and LOCAL_RANK.

torchrun gives each worker GROUP_RANK, ROLE_RANK, the TORCHELASTIC_* variables and more; Lightning takes a job for
torchrun's only when the set is complete. NCCL 2.30 and later put several ranks on one GPU when
NCCL_MULTI_RANK_GPU_ENABLE=1, and under MPS only with a cap on their blocks (measured on an H100: 3, 4 and 8 ranks
with NCCL's default blocks hung until stopped). These run against the fake GPU (an H100's 132 SMs); the GPU tier runs
NCCL itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PATHS, gpu_job_argv, run_job, shared_gpu_nccl

from mpsrun.rank.frameworks import nccl_block_cap, torchrun_layout

#: A rank that prints the variables named on its command line, NAME=value (None: unset), on one line.
SHOW = ("import os, sys; os.write(1, ' '.join([os.environ['RANK'], *(f'{n}={os.environ.get(n)}' for n in "
        "sys.argv[1:])]).encode() + b'\\n')")
NCCL = ["NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS"]
TORCHRUN = ["GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]


def shown(out, ranks: int) -> dict[int, dict[str, str]]:
    """Each rank's printed variables, by rank."""
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert sorted(int(words[0]) for words in lines) == list(range(ranks)), out.stdout
    return {int(words[0]): dict(word.split("=", 1) for word in words[1:]) for words in lines}


@pytest.fixture
def clean(monkeypatch):
    """No NCCL or torchrun variable of the test's own environment reaches the job."""
    for name in [*NCCL, *TORCHRUN, "NCCL_DEBUG", "NCCL_DEBUG_FILE", "CUDA_LOG_FILE"]:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("path", PATHS)
def test_ranks_sharing_a_gpu_get_nccls_multi_rank_variables(path, fake_gpu, clean):
    """Four ranks on one GPU under MPS get NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_MAX_CTAS=16 (half of the 33 SMs each
    rank's share of an H100 is), on every path: NCCL 2.30 and later then put them on one GPU without hanging."""
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, *NCCL], ranks=4), 4)
    assert all(seen == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "16"} for seen in ranks.values()), ranks


@pytest.mark.parametrize(("fake_gpu", "ranks", "options", "expected"), [
    (1, 2, [], ("1", "32")),  # 66 SMs each: 33, at most 32
    (1, 4, ["--mps", "off"], ("1", "None")),  # time-sliced: the ranks' blocks never run at once
    (1, 4, ["--thread-percentage", "10"], ("1", "6")),  # each rank may use 13 SMs
    (2, 2, [], ("None", "None")),  # a GPU each: NCCL needs nothing
    (2, 4, [], ("1", "32")),  # two on each GPU
    (2, 2, ["--gpu-bind", "none"], ("None", "None")),  # every rank sees both GPUs, one rank for each
    (2, 4, ["--gpu-bind", "none"], ("1", "32")),
], indirect=["fake_gpu"])
def test_nccls_variables_are_given_exactly_where_ranks_share_a_gpu(fake_gpu, clean, ranks, options, expected):
    """A rank alone on its GPU gets neither NCCL variable; ranks that share one get the multi-rank switch, and under
    MPS the cap on their blocks that their share of the SMs allows."""
    seen = shown(run_job("local", options, [sys.executable, "-c", SHOW, *NCCL], ranks=ranks), ranks)
    assert {tuple(values[name] for name in NCCL) for values in seen.values()} == {expected}, seen


@pytest.mark.parametrize("path", ["local", "per-node"])
def test_the_callers_nccl_settings_win(path, fake_gpu, clean, monkeypatch):
    """What the caller set of NCCL's variables reaches the ranks unchanged, and each one it left unset is still
    given."""
    monkeypatch.setenv("NCCL_MAX_CTAS", "4")
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, *NCCL], ranks=2), 2)
    assert all(seen == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "4"} for seen in ranks.values()), ranks
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "0")
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, *NCCL], ranks=2), 2)
    assert all(seen == {"NCCL_MULTI_RANK_GPU_ENABLE": "0", "NCCL_MAX_CTAS": "4"} for seen in ranks.values()), ranks


@pytest.mark.parametrize(("sms", "sharers", "percentage", "cap"), [
    (132, 2, None, 32), (132, 4, None, 16), (132, 8, None, 8), (132, 16, None, 4), (132, 48, None, 1),
    (132, 4, 25, 16), (132, 2, 10, 6), (108, 4, None, 13), (None, 2, None, 4), (None, 8, None, 1),
])
def test_nccls_block_cap_leaves_every_ranks_blocks_room(sms, sharers, percentage, cap):
    """Each rank's NCCL blocks are capped at half its share of the SMs (its thread percentage's, if smaller), at least
    1 and at most 32, assuming a small GPU of 16 SMs where NVML cannot say: all the ranks' blocks then fit at once."""
    assert nccl_block_cap(sms, sharers, percentage) == cap
    assert sharers * cap <= (sms or 16) or cap == 1


@pytest.mark.parametrize("path", PATHS)
def test_torchruns_whole_environment_on_every_path(path, fake_gpu, clean):
    """Every rank gets torchrun's GROUP_*, ROLE_* and TORCHELASTIC_* variables (with RANK, LOCAL_RANK and
    LOCAL_WORLD_SIZE, what Lightning needs to take the job for torchrun's), as torchrun gives them on one node."""
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, *TORCHRUN], ranks=3), 3)
    for rank, seen in ranks.items():
        assert seen == {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "3",
                        "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0"}, (rank, seen)


@pytest.mark.parametrize("path", ["mpiexec", "hosts"])
def test_the_callers_torchrun_values_win(path, fake_gpu, clean, monkeypatch):
    """A torchrun variable of the job as a whole that the caller set reaches the ranks as it is; the others are still
    given. Where a rank is (ROLE_RANK, GROUP_RANK and their sizes) is mpsrun's, as RANK is: a caller's ROLE_RANK=5
    gave every rank 5 beside its own RANK."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "nightly-7")
    for name, value in (("ROLE_RANK", "5"), ("GROUP_RANK", "9"), ("ROLE_WORLD_SIZE", "7"), ("GROUP_WORLD_SIZE", "3")):
        monkeypatch.setenv(name, value)
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, "TORCHELASTIC_RUN_ID", "ROLE_NAME", "ROLE_RANK",
                                     "GROUP_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"], ranks=2), 2)
    for rank, seen in ranks.items():
        assert seen == {"TORCHELASTIC_RUN_ID": "nightly-7", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
                        "GROUP_RANK": "0", "ROLE_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}, (rank, seen)


def test_torchruns_node_index_follows_its_layout():
    """GROUP_RANK and GROUP_WORLD_SIZE are torchrun's for consecutive ranks on nodes of equal size; without the number
    of ranks on the node they are not given."""
    assert torchrun_layout(5, 8, 4)["GROUP_RANK"] == "1"
    assert torchrun_layout(5, 8, 4)["GROUP_WORLD_SIZE"] == "2"
    assert "GROUP_RANK" not in torchrun_layout(5, 8, None)


@pytest.mark.parametrize("path", PATHS)
def test_local_rank_device_names_a_device_each_rank_sees(path, fake_gpu, clean):
    """Under --local-rank device, LOCAL_RANK is 0 in every rank that sees its one GPU (what a script that uses LOCAL_RANK
    as its device needs when ranks share a GPU); RANK is unchanged."""
    ranks = shown(run_job(path, ["--local-rank", "device"], [sys.executable, "-c", SHOW, "LOCAL_RANK"], ranks=3), 3)
    assert all(seen == {"LOCAL_RANK": "0"} for seen in ranks.values()), ranks


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_local_rank_device_spreads_ranks_that_see_every_gpu(fake_gpu, clean):
    """With --gpu-bind none every rank sees both GPUs: LOCAL_RANK under --local-rank device is the rank's place on the
    node modulo the GPUs, a device each can use; by default it is the rank's place, as torchrun's."""
    program = [sys.executable, "-c", SHOW, "LOCAL_RANK"]
    ranks = shown(run_job("local", ["--gpu-bind", "none", "--local-rank", "device"], program, ranks=4), 4)
    assert [ranks[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    ranks = shown(run_job("local", ["--gpu-bind", "none"], program, ranks=4), 4)
    assert [ranks[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "2", "3"]


# -- the GPU tier -------------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def results(out) -> list[dict]:
    """The ranks' RESULT lines, as JSON."""
    return [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_four_ranks_all_reduce_with_nccl_on_one_gpu_under_mps(path, monkeypatch):
    """Four ranks on GPU 0 under MPS all-reduce a CUDA tensor with NCCL (2.30 or later), with no NCCL variable set by
    hand: the sums are right in every rank and every rank is an MPS client (with NCCL's own blocks, 3 or more ranks
    hung until stopped; skipped, with its reason, where no such NCCL is at hand)."""
    nccl = shared_gpu_nccl()
    for name in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    program = [sys.executable, str(EXAMPLES / "torch_allreduce.py"), "--iterations", "5"]
    out = subprocess.run(gpu_job_argv(path, ["-v", "--timeout", "240", *nccl], program, ranks=4), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = results(out)
    assert len(found) == 4 and all(r["right"] for r in found), out.stdout
    assert {tuple(map(int, r["nccl"].split(".")))[:2] >= (2, 30) for r in found} == {True}, found
    assert "4 of 4 ranks connected to MPS" in out.stderr, out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["local", "per-node"])
def test_a_torchrun_script_runs_with_four_ranks_on_one_gpu(path, monkeypatch):
    """DDP written as torchrun scripts are (LOCAL_RANK is the device), four ranks on GPU 0 under MPS with NCCL 2.30 or
    later: it trains under --local-rank device, and the replicas stay equal."""
    nccl = shared_gpu_nccl()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    program = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--steps", "50"]
    out = subprocess.run(gpu_job_argv(path, ["--local-rank", "device", "--timeout", "240", *nccl], program, ranks=4),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = results(out)
    assert len(found) == 4 and all(r["replicas_equal"] for r in found), out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_a_torchrun_script_runs_with_one_rank_per_gpu(path, monkeypatch):
    """The same DDP script, one rank on each of two GPUs with --gpu-bind none and torch's own NCCL: it trains, as
    under torchrun (under the default binding rank 1 had no device 1)."""
    pytest.importorskip("torch")
    if subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.device_count() >= 2"],
                      capture_output=True, timeout=120).returncode:
        pytest.skip("needs two GPUs")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    program = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--steps", "50"]
    argv = gpu_job_argv(path, ["--gpu-bind", "none", "--timeout", "240"], program, ranks=2)
    argv[argv.index("--gpus") + 1] = "0,1"
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = results(out)
    assert len(found) == 2 and all(r["replicas_equal"] for r in found), out.stdout
