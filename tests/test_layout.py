"""The parallel layout's maps between ranks and (stage, replica), and its device mesh."""

import itertools

import pytest
import torch

from nobubble.config import ConfigError
from nobubble.layout import ParallelLayout

SHAPES = [(1, 1), (4, 1), (1, 3), (2, 2), (3, 2), (2, 4)]  # (pp, dp)


def layouts(pp: int, dp: int) -> list[ParallelLayout]:
    return [ParallelLayout(pp, dp, rank) for rank in range(pp * dp)]


@pytest.mark.parametrize(("pp", "dp"), SHAPES)
def test_every_rank_has_its_own_place_and_back(pp, dp):
    places = [(lay.pp_rank, lay.replica) for lay in layouts(pp, dp)]
    assert sorted(places) == list(itertools.product(range(pp), range(dp)))
    for lay in layouts(pp, dp):
        assert lay.coordinates(lay.rank) == (lay.pp_rank, lay.replica)
        assert lay.rank_of(lay.pp_rank, lay.replica) == lay.rank
        assert lay.rank_of(lay.pp_rank) == lay.rank  # the replica defaults to its own


@pytest.mark.parametrize(("pp", "dp"), SHAPES)
def test_ranks_follow_the_device_mesh_order_with_dp_innermost(pp, dp):
    """init_device_mesh lays ranks out row-major over (pp, dp): the layout must agree."""
    grid = torch.arange(pp * dp).reshape(pp, dp)
    lay = ParallelLayout(pp, dp)
    assert [[lay.rank_of(s, r) for r in range(dp)] for s in range(pp)] == grid.tolist()


@pytest.mark.parametrize(("pp", "dp"), SHAPES)
def test_neighbours_are_the_next_stages_of_the_same_replica(pp, dp):
    for lay in layouts(pp, dp):
        assert lay.is_first_stage == (lay.pp_rank == 0)
        assert lay.is_last_stage == (lay.pp_rank == pp - 1)
        if not lay.is_last_stage:
            after = ParallelLayout(pp, dp, lay.rank_of(lay.pp_rank + 1))
            assert (after.pp_rank, after.replica) == (lay.pp_rank + 1, lay.replica)


@pytest.mark.parametrize(("pp", "dp"), SHAPES)
def test_one_leader_and_one_shard_per_stage(pp, dp):
    everyone = layouts(pp, dp)
    assert [lay.rank for lay in everyone if lay.is_leader] == [0]
    assert {lay.leader for lay in everyone} == {0}
    leader = everyone[0]
    assert leader.is_first_stage and leader.replica == 0
    assert {lay.shard for lay in everyone} == set(range(pp))
    assert all(lay.shard == lay.pp_rank and lay.shards == pp for lay in everyone)


def test_with_one_replica_rank_is_stage():
    assert [lay.pp_rank for lay in layouts(4, 1)] == [0, 1, 2, 3]
    assert ParallelLayout(4, 1, 2).name(3) == "stage 3"
    assert ParallelLayout(2, 2, 3).name() == "stage 1 of replica 1"


def test_chunks_put_model_stage_c_times_p_plus_r_on_pipeline_rank_r():
    """Interleaved schedules' virtual stages (Megatron's placement), with replicas."""
    everyone = [ParallelLayout(3, 2, rank, chunks=2) for rank in range(6)]
    assert [lay.stages for lay in everyone] == [(0, 3), (0, 3), (1, 4), (1, 4), (2, 5), (2, 5)]
    lay = everyone[3]  # pipeline rank 1 of replica 1
    assert lay.model_stages == 6
    assert [lay.rank_of(stage) for stage in range(6)] == [1, 3, 5, 1, 3, 5]
    assert [lay.chunk_of(stage) for stage in range(6)] == [0, 0, 0, 1, 1, 1]
    assert lay.name() == "stages 1, 4 of replica 1" and lay.name(4) == "stage 4 of replica 1"
    assert [(x.is_first_stage, x.is_last_stage) for x in everyone[::2]] == [
        (True, False),
        (False, False),
        (False, True),  # holds the head's stage 5
    ]
    assert {x.shard for x in everyone} == {0, 1, 2} and lay.shards == 3
    with pytest.raises(ValueError, match=r"no stage 6 of replica 0 .* chunks=2"):
        lay.rank_of(6, 0)


def test_a_launch_of_the_wrong_size_is_refused_with_the_command_to_run():
    assert ParallelLayout.from_world(2, 2, 3, 4) == ParallelLayout(2, 2, 3)
    with pytest.raises(
        ConfigError,
        match=r"started 3 processes .* stages=2; run `torchrun "
        r"--nproc-per-node 2 \.\.\.` or pass --stages 3",
    ):
        ParallelLayout.from_world(2, 1, 0, 3)
    with pytest.raises(
        ConfigError,
        match=r"stages=2 x dp=2 = 4 processes; run `torchrun "
        r"--nproc-per-node 4 \.\.\.`$",
    ):
        ParallelLayout.from_world(2, 2, 0, 3)


def test_places_outside_the_layout_are_errors():
    with pytest.raises(ValueError, match="must be >= 1"):
        ParallelLayout(0)
    with pytest.raises(ValueError, match="rank 4 is not in a layout of 4"):
        ParallelLayout(2, 2, 4)
    lay = ParallelLayout(2, 2)
    with pytest.raises(ValueError, match="rank -1"):
        lay.coordinates(-1)
    with pytest.raises(ValueError, match="no stage 2 of replica 0"):
        lay.rank_of(2)
    with pytest.raises(ValueError, match="no stage 0 of replica 2"):
        lay.rank_of(0, 2)


def _mesh_groups(rank: int, port: int, results, dp: int = 2, tp: int = 1) -> None:
    import datetime

    import torch.distributed as dist

    from nobubble.layout import device_mesh

    limit = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=limit)
    mesh = device_mesh(ParallelLayout(2, dp, rank, tp=tp), "cpu")
    dims = ("pp", "dp", "tp") if tp > 1 else ("pp", "dp")
    groups = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in dims}
    results.put((rank, groups))
    del mesh
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)])
def test_the_device_mesh_groups_are_the_layouts_replicas_and_pipelines(dp, tp):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_mesh_groups, args=(port, results, dp, tp), nprocs=4, start_method="spawn")
    for rank, groups in sorted(results.get() for _ in range(4)):
        lay = ParallelLayout(2, dp, rank, tp=tp)
        assert groups["pp"] == [lay.rank_of(stage) for stage in range(2)]
        assert groups["dp"] == [lay.rank_of(lay.pp_rank, replica) for replica in range(dp)]
        if tp > 1:  # a stage's tp ranks: its own, neighbours
            assert groups["tp"] == [lay.rank_of(lay.pp_rank, 0, t) for t in range(tp)]
