"""The parallel layout (data x pipeline x tensor) and the device mesh built from it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch.distributed as dist

from lightning_pipe.mesh import (
    MeshAxis,
    NodePlacement,
    ParallelLayout,
    RankCoordinates,
    check_tensor_groups_in_nodes,
    init_mesh,
)
from tests.distributed import run_distributed

# ---------------------------------------------------------------------------------------- resolve


def test_resolve_auto_data_parallel_size() -> None:
    assert ParallelLayout.resolve(8, pipeline_parallel_size=2) == ParallelLayout(4, 2, 1)
    assert ParallelLayout.resolve(8, pipeline_parallel_size=2, tensor_parallel_size=2) == ParallelLayout(
        2, 2, 2
    )
    assert ParallelLayout.resolve(4, pipeline_parallel_size=4) == ParallelLayout(1, 4, 1)
    assert ParallelLayout.resolve(1) == ParallelLayout(1, 1, 1)
    assert ParallelLayout.resolve(6, tensor_parallel_size=3).shape == (2, 1, 3)


def test_resolve_explicit_sizes() -> None:
    layout = ParallelLayout.resolve(
        12, pipeline_parallel_size=3, tensor_parallel_size=2, data_parallel_size=2
    )
    assert layout.shape == (2, 3, 2)
    assert layout.world_size == 12
    assert str(layout) == "dp=2 x pp=3 x tp=2"


def test_resolve_product_not_world_size() -> None:
    with pytest.raises(ValueError) as info:
        ParallelLayout.resolve(8, pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=3)
    message = str(info.value)
    assert "data_parallel_size (3) x pipeline_parallel_size (2) x tensor_parallel_size (2) = 12" in message
    assert "but the world size is 8" in message
    assert 'data_parallel_size="auto"' in message
    with pytest.raises(ValueError, match=r"= 2, but the world size is 4\..*data_parallel_size=\"auto\""):
        ParallelLayout.resolve(4, pipeline_parallel_size=2, data_parallel_size=1)


def test_resolve_auto_when_sizes_do_not_divide_world() -> None:
    with pytest.raises(
        ValueError,
        match=(
            r"pipeline_parallel_size \(3\) x tensor_parallel_size \(1\) = 3 "
            r"does not divide the world size 4"
        ),
    ):
        ParallelLayout.resolve(4, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="= 4 does not divide the world size 6"):
        ParallelLayout.resolve(6, pipeline_parallel_size=2, tensor_parallel_size=2)


PP_MSG = "pipeline_parallel_size must be an integer >= 1 or 'auto'"


def test_resolve_auto_pipeline_takes_what_remains() -> None:
    # Both "auto": one pipeline over every device (per tensor group), no data parallelism.
    assert ParallelLayout.resolve(4, "auto").shape == (1, 4, 1)
    assert ParallelLayout.resolve(8, "auto", tensor_parallel_size=2).shape == (1, 4, 2)
    assert ParallelLayout.resolve(8, "auto", data_parallel_size=2).shape == (2, 4, 1)
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        ParallelLayout.resolve(6, "auto", data_parallel_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 0}, f"{PP_MSG}, got 0"),
        ({"tensor_parallel_size": -1}, "tensor_parallel_size must be an integer >= 1, got -1"),
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1 or 'auto', got 0"),
        ({"pipeline_parallel_size": 2.0}, f"{PP_MSG}, got 2\\.0"),
        ({"pipeline_parallel_size": True}, f"{PP_MSG}, got True"),
        ({"data_parallel_size": "Auto"}, "data_parallel_size must be an integer >= 1 or 'auto', got 'Auto'"),
    ],
    ids=["pp0", "tp-negative", "dp0", "pp-float", "pp-bool", "dp-bad-string"],
)
def test_resolve_rejects_bad_sizes(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelLayout.resolve(4, **kwargs)


def test_layout_rejects_bad_sizes_directly() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        ParallelLayout(0, 1, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        ParallelLayout(1, 1, 0)


# ---------------------------------------------------------------------------------------- coordinates


def test_coordinates_rank_of_round_trip_dp2_pp2_tp2() -> None:
    layout = ParallelLayout(2, 2, 2)
    seen = []
    for dp, pp, tp in itertools.product(range(2), repeat=3):
        rank = layout.rank_of(dp, pp, tp)
        assert rank == (dp * 2 + pp) * 2 + tp
        assert layout.coordinates(rank) == RankCoordinates(dp, pp, tp)
        seen.append(rank)
    assert sorted(seen) == list(range(8))
    # Tensor axis innermost, data axis outermost.
    assert layout.coordinates(1) == RankCoordinates(0, 0, 1)
    assert layout.coordinates(2) == RankCoordinates(0, 1, 0)
    assert layout.coordinates(4) == RankCoordinates(1, 0, 0)
    assert layout.coordinates(7) == RankCoordinates(1, 1, 1)


def test_coordinates_round_trip_uneven_sizes() -> None:
    layout = ParallelLayout(3, 4, 2)
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        assert 0 <= c.dp_rank < 3 and 0 <= c.pp_rank < 4 and 0 <= c.tp_rank < 2
        assert layout.rank_of(c.dp_rank, c.pp_rank, c.tp_rank) == rank


def test_coordinates_outside_world() -> None:
    layout = ParallelLayout(2, 2, 2)
    with pytest.raises(ValueError, match="Rank 8 is outside a world of 8 processes"):
        layout.coordinates(8)
    with pytest.raises(ValueError, match="Rank -1 is outside a world of 8 processes"):
        layout.coordinates(-1)


def test_pipeline_ranks() -> None:
    layout = ParallelLayout(2, 2, 2)
    assert layout.pipeline_ranks(0) == [0, 2]
    assert layout.pipeline_ranks(2) == [0, 2]
    assert layout.pipeline_ranks(1) == [1, 3]
    assert layout.pipeline_ranks(5) == [5, 7]
    assert layout.pipeline_ranks(6) == [4, 6]
    # Every rank is in exactly one pipeline, at its own pp_rank.
    for rank in range(8):
        peers = layout.pipeline_ranks(rank)
        assert peers[layout.coordinates(rank).pp_rank] == rank
    assert ParallelLayout(1, 4, 1).pipeline_ranks(3) == [0, 1, 2, 3]
    assert ParallelLayout(3, 1, 1).pipeline_ranks(2) == [2]


def test_mesh_axis_names_outermost_first() -> None:
    assert [a.value for a in MeshAxis] == ["dp", "pp", "tp"]


# ---------------------------------------------------------------------------------------- nodes


def _placed(node_ranks: list[int]) -> NodePlacement:
    return NodePlacement(tuple(node_ranks), tuple(f"host{n}" for n in node_ranks))


def test_tensor_groups_inside_nodes_when_tp_divides_the_processes_per_node() -> None:
    """The layout rule: tensor groups in one node, pipeline (then data) across nodes. With ranks
    numbered node by node, pp=2 x tp=2 on 2 nodes of 2 puts one stage's tensor group on each node;
    dp=2 x pp=2 x tp=2 on 2 nodes of 4 puts one replica's whole pipeline on each."""
    for tp, per_node, nodes in [(2, 2, 2), (2, 4, 2), (1, 1, 4), (4, 8, 2), (3, 2, 1)]:
        check_tensor_groups_in_nodes(tp, per_node, nodes)  # fits (one node: anything fits)
    pp2_tp2 = ParallelLayout(1, 2, 2)
    by_node = _placed([0, 0, 1, 1])
    by_node.check(pp2_tp2)
    assert by_node.describe(pp2_tp2).splitlines()[1:] == [
        "    node 0 (host0): ranks 0-1: dp_rank 0 pp_rank 0",
        "    node 1 (host1): ranks 2-3: dp_rank 0 pp_rank 1",
    ]
    three_d = ParallelLayout(2, 2, 2)
    _placed([0] * 4 + [1] * 4).check(three_d)
    assert "node 1 (host1): ranks 4-7: dp_rank 1 pp_rank 0; dp_rank 1 pp_rank 1" in _placed(
        [0] * 4 + [1] * 4
    ).describe(three_d)


@pytest.mark.parametrize(("tp", "per_node", "fits"), [(4, 2, [1, 2]), (2, 3, [1, 3])])
def test_a_tensor_group_that_would_span_nodes_is_refused_naming_the_sizes(
    tp: int, per_node: int, fits: list[int]
) -> None:
    with pytest.raises(ValueError) as info:
        check_tensor_groups_in_nodes(tp, per_node, 2)
    message = str(info.value)
    assert f"tensor_parallel_size={tp} does not divide the {per_node} processes (devices) per node" in message
    assert f"use a tensor_parallel_size that divides {per_node} (one of {fits})" in message


def test_a_placement_that_interleaves_nodes_is_refused() -> None:
    """SLURM's cyclic distribution numbers ranks across nodes in turn: rank 0 and 1 (one tensor
    group) land on different nodes, whatever the sizes; the check reads where they really are."""
    with pytest.raises(ValueError) as info:
        _placed([0, 1, 0, 1]).check(ParallelLayout(1, 2, 2))
    message = str(info.value)
    assert "tensor-parallel group of dp_rank 0, pp_rank 0 spans nodes [0, 1]" in message
    assert "rank 0 on node 0 (host0), rank 1 on node 1 (host1)" in message
    assert "--distribution=cyclic" in message
    _placed([0, 1, 0, 1]).check(ParallelLayout(1, 4, 1))  # no tensor groups: nothing to keep together


# ---------------------------------------------------------------------------------------- init_mesh


def test_init_mesh_needs_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed to be initialised first"):
        init_mesh(ParallelLayout(), "cpu")


def mesh_worker() -> dict[str, Any]:
    rank = dist.get_rank()
    layout = ParallelLayout.resolve(4, pipeline_parallel_size=2)
    mesh = init_mesh(layout, "cpu")
    wrong = None
    try:
        init_mesh(ParallelLayout(1, 2, 1), "cpu")
    except ValueError as err:
        wrong = str(err)
    experts = init_mesh(ParallelLayout(4, 1, 1, expert_parallel_size=2), "cpu")
    no_experts = init_mesh(ParallelLayout(4, 1, 1), "cpu")
    return {
        "expert_group": dist.get_process_group_ranks(experts.expert_group),
        "expert_data_group": dist.get_process_group_ranks(experts.expert_data_group),
        "no_expert_group": no_experts.expert_group,
        "no_expert_data_group": dist.get_process_group_ranks(no_experts.expert_data_group),
        "rank": rank,
        "mesh_rank": mesh.rank,
        "coordinates": mesh.coordinates,
        "pipeline_peers": mesh.pipeline_peers,
        "pipeline_group": dist.get_process_group_ranks(mesh.group(MeshAxis.PIPELINE)),
        "data_group": dist.get_process_group_ranks(mesh.group(MeshAxis.DATA)),
        "tensor_group": dist.get_process_group_ranks(mesh.group(MeshAxis.TENSOR)),
        "wrong_world": wrong,
    }


@pytest.mark.distributed
def test_init_mesh_groups_match_layout() -> None:
    results = run_distributed(mesh_worker, 4, timeout=120)
    layout = ParallelLayout(2, 2, 1)
    for rank, got in enumerate(results):
        c = layout.coordinates(rank)
        assert got["rank"] == got["mesh_rank"] == rank
        assert got["coordinates"] == c
        assert got["pipeline_group"] == got["pipeline_peers"] == layout.pipeline_ranks(rank)
        assert got["pipeline_group"] == [2 * c.dp_rank, 2 * c.dp_rank + 1]
        assert got["data_group"] == [layout.rank_of(d, c.pp_rank, c.tp_rank) for d in range(2)]
        assert got["data_group"] == [c.pp_rank, 2 + c.pp_rank]
        assert got["tensor_group"] == [rank]
        assert got["wrong_world"] == "The layout dp=1 x pp=2 x tp=1 needs 2 processes but the world has 4."
        # dp=4 with expert_parallel_size=2: experts split over consecutive data ranks {0,1}, {2,3};
        # ranks with the same experts {0,2}, {1,3}; without an expert axis, the data group.
        assert got["expert_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["expert_data_group"] == [rank % 2, rank % 2 + 2]
        assert got["no_expert_group"] is None
        assert got["no_expert_data_group"] == [0, 1, 2, 3]


def test_expert_groups_borrow_from_the_data_axis() -> None:
    """dp=4 x pp=2 x tp=2 with expert_parallel_size=2: an expert group is two consecutive dp_rank
    values at the same pp_rank and tp_rank; the expert-data group the other two."""
    layout = ParallelLayout(4, 2, 2, expert_parallel_size=2)
    rank = layout.rank_of(3, 1, 0)
    assert layout.expert_ranks(rank) == [layout.rank_of(2, 1, 0), layout.rank_of(3, 1, 0)]
    assert layout.expert_data_ranks(rank) == [layout.rank_of(1, 1, 0), layout.rank_of(3, 1, 0)]
    assert layout.ep_rank(rank) == 1
    assert str(layout) == "dp=4 (ep=2) x pp=2 x tp=2"
    groups = {tuple(layout.expert_ranks(r)) for r in range(layout.world_size)}
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))  # a partition
    assert ParallelLayout.resolve(8, 2, 1, expert_parallel_size=2).expert_parallel_size == 2


def test_an_expert_size_that_does_not_divide_the_data_axis_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=3 does not divide data_parallel_size=4.*\[1, 2, 4\]"
    ):
        ParallelLayout(4, 1, 1, expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size must be an integer >= 1, got 0"):
        ParallelLayout(4, 1, 1, expert_parallel_size=0)
