"""PyTorch's launcher conventions (issue 35): torchrun's whole environment, NCCL on a shared GPU, and LOCAL_RANK.

torchrun gives each worker GROUP_RANK, ROLE_RANK, the TORCHELASTIC_* variables and more; Lightning takes a job for
torchrun's only when the set is complete. NCCL 2.30 and later put several ranks on one GPU when
NCCL_MULTI_RANK_GPU_ENABLE=1, and under MPS only with a cap on their blocks (measured on an H100: 3, 4 and 8 ranks
with NCCL's default blocks hung until stopped). These run against the fake GPU (an H100's 132 SMs); the GPU tier runs
NCCL itself.
"""

from __future__ import annotations

import sys

import pytest
from helpers import PATHS, run_job

from mpsrun.rank.frameworks import nccl_block_cap, torchrun_variables

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
    """A torchrun variable the caller set reaches the ranks as it is; the others are still given."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "nightly-7")
    ranks = shown(run_job(path, [], [sys.executable, "-c", SHOW, "TORCHELASTIC_RUN_ID", "ROLE_NAME"], ranks=2), 2)
    assert all(seen == {"TORCHELASTIC_RUN_ID": "nightly-7", "ROLE_NAME": "default"} for seen in ranks.values())


def test_torchruns_node_index_follows_its_layout():
    """GROUP_RANK and GROUP_WORLD_SIZE are torchrun's for consecutive ranks on nodes of equal size; without the number
    of ranks on the node they are not given."""
    assert torchrun_variables(5, 8, 4)["GROUP_RANK"] == "1"
    assert torchrun_variables(5, 8, 4)["GROUP_WORLD_SIZE"] == "2"
    assert "GROUP_RANK" not in torchrun_variables(5, 8, None)


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
