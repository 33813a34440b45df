"""Unit tests: rank placement and per-rank environments (pure functions)."""

import pytest

from mpsrun.errors import ConfigError
from mpsrun.placement import parse_thread_spec, plan_ranks, rank_environments

MPS_GPU = [{"CUDA_VISIBLE_DEVICES": "GPU-a", "CUDA_MPS_PIPE_DIRECTORY": "/p/a"},
           {"CUDA_VISIBLE_DEVICES": "GPU-b", "CUDA_MPS_PIPE_DIRECTORY": "/p/b"}]


@pytest.mark.parametrize(
    ("n", "g", "policy", "expected"),
    [(4, 2, "block", [0, 0, 1, 1]), (5, 2, "block", [0, 0, 0, 1, 1]), (4, 2, "round-robin", [0, 1, 0, 1]),
     (3, 4, "block", [0, 1, 2]), (1, 1, "block", [0])],
)
def test_gpu_of_each_rank(n, g, policy, expected):
    """block gives contiguous even chunks per GPU; round-robin deals ranks out in turn."""
    assert [p.gpu for p in plan_ranks(n, g, policy)] == expected


def test_auto_thread_percentage_divides_each_gpu():
    """auto gives 100 / (ranks sharing that GPU), at least 1."""
    assert [p.thread_percentage for p in plan_ranks(5, 2, "block", "auto")] == [33, 33, 33, 50, 50]
    assert {p.thread_percentage for p in plan_ranks(300, 1, "block", "auto")} == {1}


def test_per_rank_list_and_single_value():
    """A list gives each rank its own value; a single value applies to all."""
    assert [p.thread_percentage for p in plan_ranks(3, 1, "block", [10, 20, 30])] == [10, 20, 30]
    assert {p.thread_percentage for p in plan_ranks(3, 1, "block", 40)} == {40}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"nranks": 0}, "positive integer"), ({"nranks": True}, "positive integer"), ({"ngpus": 0}, "no GPU"),
     ({"policy": "socket"}, "block or round-robin"), ({"thread_percentage": [10, 20]}, "lists 2 values but there are 3"),
     ({"thread_percentage": [10, 200, 5]}, "from 1 to 100"), ({"mem_limit": "12Q"}, "--mem-limit"),
     ({"priority": 3}, "--priority")],
)
def test_impossible_requests_are_refused(kwargs, message):
    """Wrong counts, policies, list lengths and limits raise ConfigError before anything starts."""
    args = {"nranks": 3, "ngpus": 1, "policy": "block", **kwargs}
    with pytest.raises(ConfigError, match=message):
        plan_ranks(args.pop("nranks"), args.pop("ngpus"), args.pop("policy"), **args)


def test_rank_environments_carry_gpu_limits_and_rank_variables():
    """Each rank gets its GPU's session variables, its limits (only under MPS) and rank variables."""
    plan = plan_ranks(2, 2, "block", [30, 70], "2G", 1)
    envs = rank_environments(plan, MPS_GPU)
    assert envs[1] == {**MPS_GPU[1], "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G",
                       "CUDA_MPS_CLIENT_PRIORITY": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MPSRUN_RANK": "1", "MPSRUN_GPU": "1"}
    no_mps = rank_environments(plan, [{"CUDA_VISIBLE_DEVICES": "GPU-a"}, {"CUDA_VISIBLE_DEVICES": "GPU-b"}])
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in no_mps[0]


def test_thread_spec_text():
    """--thread-percentage text: auto, one value, or a list."""
    assert parse_thread_spec("AUTO") == "auto" and parse_thread_spec("25") == 25
    assert parse_thread_spec("10, 20") == [10, 20]
    with pytest.raises(ConfigError):
        parse_thread_spec("10,x")
