"""Unit tests: rank placement and the one function that builds a rank's environment (pure functions)."""

import pytest

from mpsrun.agent.welcome import welcome
from mpsrun.config.options import JobConfig
from mpsrun.errors import ConfigError
from mpsrun.mps.environment import GpuTarget
from mpsrun.mps.placement import NodePlan, RankPlan, gpu_of_rank, rank_environment, ranks_on_gpus, ranks_per_gpu
from mpsrun.rank.identity import RankIdentity

MPS_GPUS = [GpuTarget("GPU-a", "/p/a", "/l/a", "/s"), GpuTarget("GPU-b", "/p/b", "/l/b", "/s")]


def config(**fields):
    return JobConfig(command=("x",), **fields)


def plan_job(nranks, ngpus, job, free=()):
    """Every rank of a one-node job of ``nranks`` ranks."""
    return NodePlan.make(job, ngpus, nranks, free).ranks(nranks)


def plan_rank(identity, ngpus, job, free=()):
    """One rank's plan, on a node of the size its identity says."""
    return NodePlan.make(job, ngpus, identity.local_world_size, free).rank(identity)


@pytest.mark.parametrize(
    ("n", "g", "policy", "expected"),
    [(4, 2, "block", [0, 0, 1, 1]), (5, 2, "block", [0, 0, 0, 1, 1]), (4, 2, "round-robin", [0, 1, 0, 1]),
     (3, 4, "block", [0, 1, 2]), (1, 1, "block", [0])],
)
def test_gpu_of_each_rank(n, g, policy, expected):
    """block gives contiguous even chunks per GPU; round-robin deals ranks out in turn."""
    assert [p.gpu for p in plan_job(n, g, config(map_by=policy))] == expected


@pytest.mark.parametrize("policy", ["block", "round-robin"])
def test_ranks_per_gpu_counts_what_gpu_of_rank_places(policy):
    """The counted ranks per GPU (each rank's plan asks; going through every rank made planning quadratic: 90 s
    for 20,000 ranks) are exactly where gpu_of_rank puts each rank, for every size up to 120 ranks on 1 to 9 GPUs."""
    for ngpus in range(1, 10):
        for local_size in range(1, 121):
            placed = [gpu_of_rank(rank, local_size, ngpus, policy) for rank in range(local_size)]
            assert ranks_per_gpu(local_size, ngpus, policy) == [placed.count(gpu) for gpu in range(ngpus)]


def test_auto_thread_percentage_divides_each_gpu():
    """auto gives 100 / (ranks sharing that GPU), at least 1, by the same formula on every path."""
    assert [p.thread_percentage for p in plan_job(5, 2, config(thread_percentage="auto"))] == [33, 33, 33, 50, 50]
    assert {p.thread_percentage for p in plan_job(300, 1, config(thread_percentage="auto"))} == {1}
    # a per-node rank: 3 local ranks of a 6-rank job share one GPU
    node_rank = RankIdentity(rank=4, local_rank=1, world_size=6, local_world_size=3)
    assert plan_rank(node_rank, 1, config(thread_percentage="auto")).thread_percentage == 33


def test_per_rank_list_and_single_value():
    """A list gives each rank its own value (by global rank); a single value applies to all."""
    assert [p.thread_percentage for p in plan_job(3, 1, config(thread_percentage=(10, 20, 30)))] == [10, 20, 30]
    assert {p.thread_percentage for p in plan_job(3, 1, config(thread_percentage=40))} == {40}
    node_rank = RankIdentity(rank=3, local_rank=0, world_size=4, local_world_size=2)
    assert plan_rank(node_rank, 1, config(thread_percentage=(1, 2, 3, 4))).thread_percentage == 4


@pytest.mark.parametrize(
    ("identity", "fields", "message"),
    [(RankIdentity(0, 0, 3, 3), {"thread_percentage": (10, 20)}, "lists 2 values but there are 3"),
     (RankIdentity(0, 0, None, None), {"thread_percentage": "auto", "map_by": "round-robin"},
      "auto needs the number of ranks on this node"),
     (RankIdentity(0, 0, None, None), {"map_by": "block"}, "block needs the number of ranks on this node")],
)
def test_what_cannot_be_honoured_is_refused(identity, fields, message):
    """A list of the wrong length, or auto/block without the node's rank count, raises ConfigError (never dropped)."""
    with pytest.raises(ConfigError, match=message):
        plan_rank(identity, 2, config(**fields))


@pytest.mark.parametrize(("policy", "expected"), [("block", [1251, 1250, 1251, 1250, 1250, 1251, 1250, 1250]),
                                                ("round-robin", [1251, 1251, 1251, 1250, 1250, 1250, 1250, 1250])])
def test_a_node_of_ten_thousand_ranks_is_planned_whole(policy, expected):
    """10,003 ranks on 8 GPUs with thread percentage and memory limit auto: every rank is planned, each GPU gets the
    ranks gpu_of_rank puts there, and each rank's limits are its GPU's share (the node's plan is worked out once,
    so planning is linear in the ranks; the time at 1,000 and 10,000 ranks is in docs/benchmarks.md)."""
    free = [2 << 40] * 8  # 2 TiB each: room for a 1 GiB share per rank
    plans = plan_job(10_003, 8, config(map_by=policy, thread_percentage="auto", mem_limit="auto"), free)
    counts = ranks_on_gpus(plans)
    assert [counts[gpu] for gpu in range(8)] == expected == ranks_per_gpu(10_003, 8, policy)
    assert [p.rank for p in plans] == list(range(10_003))
    assert all(p.thread_percentage == 1 and p.sharers == expected[p.gpu] for p in plans)  # 100 // 1250: at least 1
    assert all(p.mem_limit == ((2 << 20) - 128) // expected[p.gpu] for p in plans)


@pytest.mark.parametrize(("ranks", "expected"), [(1, "8"), (8, "8"), (16, "7"), (48, "2")])
def test_mps_clients_get_their_share_of_the_servers_queues(ranks, expected):
    """Under --queues auto a rank under MPS gets CUDA_DEVICE_MAX_CONNECTIONS as a plain process has them (8) while
    its GPU's 126 last, else its share: 1, 8, 16 and 48 ranks on one GPU get 8, 8, 7 and 2. --queues 3 gives 3
    whatever the count; without --queues nothing is set (MPS's default of 2). Its supervisor learns the clients and
    the queues they share, to explain a context that failed for want of them."""
    def queues(**settings: object) -> str | None:
        node = NodePlan.make(config(**settings), 1, ranks)
        given = welcome(RankIdentity(0, 0, ranks, ranks), node, lambda gpu: MPS_GPUS[gpu], False)[0]
        assert (given.gpu_clients, given.gpu_queues) == (ranks, 126)
        assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in group for group in given.defaults)
        return given.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    assert (queues(queues="auto"), queues(queues=3), queues()) == (expected, "3", None)


def test_the_queues_are_planned_per_server_and_only_under_mps():
    """Under --gpu-bind none one server serves every rank of the node, which may all pick one GPU (16 ranks on 2 GPUs:
    7 each), and which GPU each uses is not known (no clients per GPU are sent); a rank without MPS gets no planned
    queue count."""
    node = NodePlan.make(config(gpu_bind="none", queues="auto"), 2, 16)
    given = welcome(RankIdentity(3, 3, 16, 16), node, lambda gpu: MPS_GPUS[gpu], False)[0]
    assert given.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "7"
    assert (given.gpu_clients, given.gpu_queues) == (None, None)
    node = NodePlan.make(config(queues=4), 1, 1)
    alone = welcome(RankIdentity(0, 0, 1, 1), node, lambda gpu: GpuTarget("GPU-a"), False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in alone[0].env


def test_rank_environment_carries_gpu_limits_and_rank_variables():
    """A rank gets its GPU's daemon variables, its limits (only under MPS) and its rank variables (torchrun's
    layout among them)."""
    plan = RankPlan(rank=1, gpu=1, thread_percentage=70, mem_limit=2048, priority=1)
    env = rank_environment(MPS_GPUS[1], plan, RankIdentity(1, 1, 2, 2))
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b", "CUDA_MPS_PIPE_DIRECTORY": "/p/b", "CUDA_MPS_LOG_DIRECTORY": "/l/b",
                   "MPSRUN_SESSION_DIR": "/s", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G", "CUDA_MPS_CLIENT_PRIORITY": "1", "MPSRUN_GPU": "1",
                   "RANK": "1", "LOCAL_RANK": "1", "MPSRUN_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
    no_mps = rank_environment(GpuTarget("GPU-a"), plan, RankIdentity(1, 1, 2, 2))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in no_mps and no_mps["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert rank_environment(None, None, RankIdentity(0, 0, None, None)) == {
        "RANK": "0", "LOCAL_RANK": "0", "MPSRUN_RANK": "0", "ROLE_RANK": "0"}


def test_welcome_tells_the_supervisor_everything():
    """The welcome holds the rank's variables, what mpsrun manages (stale values are dropped), tagging and grace."""
    answer, plan = welcome(RankIdentity(3, 3, 4, 4), NodePlan.make(config(tag_output=True, grace=2.0), 2, 4),
                           lambda gpu: MPS_GPUS[gpu], False)
    assert answer.env["CUDA_VISIBLE_DEVICES"] == "GPU-b" and answer.env["RANK"] == "3"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in answer.managed
    assert answer.tag is True and answer.grace == 2.0
    assert plan is not None and plan.unlimited_sharing and (plan.gpu, plan.sharers) == (1, 2)  # GPU 1, shared by
    # ranks 2 and 3 with no memory limit
