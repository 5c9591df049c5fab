"""The mesh's rank arithmetic (tp-ep-edp-pp, TP fastest), checked against Megatron's docstring
example, and the `Mesh` that always has every group."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer.comm.mesh import GROUPS, Mesh, splits
from trainer.comm.topology import AXES, MeshShape
from trainer.errors import TopologyError

# Megatron parallel_state.py docstring: 16 GPUs, TP=2, PP=4, hence DP=2.
MEGATRON = MeshShape(dp=2, tp=2, pp=4)


def test_megatron_16_gpu_example_tensor_parallel_groups_are_adjacent_pairs():
    assert MEGATRON.groups("tp") == tuple((2 * i, 2 * i + 1) for i in range(8))


def test_megatron_16_gpu_example_data_parallel_groups_stride_by_tp():
    assert MEGATRON.groups("dp") == (
        (0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15))


def test_megatron_16_gpu_example_pipeline_groups_stride_by_tp_times_dp():
    assert MEGATRON.groups("pp") == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))


@pytest.mark.parametrize("shape", [MeshShape(2, 2, 4), MeshShape(3, 2, 2), MeshShape(1, 4, 1),
                                   MeshShape(4, 1, 2, ep=2), MeshShape(1, 1, 1),
                                   MeshShape(8, 2, 1, ep=2, shard=2)])
def test_the_rank_formula_and_the_coordinates_are_inverse_for_every_rank(shape):
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        edp_rank = c["zs"] + shape.sizes["zs"] * c["zr"]
        assert shape.coord(rank, "edp") == edp_rank
        dp_rank = c["ep"] + shape.ep * edp_rank
        assert rank == c["tp"] + shape.tp * (dp_rank + shape.dp * c["pp"])
        assert shape.coord(rank, "dp") == dp_rank
        assert shape.rank_of(c) == rank


@pytest.mark.parametrize("shape", [MeshShape(2, 2, 4), MeshShape(4, 2, 2, ep=2),
                                   MeshShape(2, 1, 3), MeshShape(4, 2, 1, shard=2)])
@pytest.mark.parametrize("axes", [("tp",), ("ep",), ("edp",), ("dp",), ("pp",), ("tp", "pp"),
                                  ("tp", "ep", "pp"), ("zs",), ("zr",)])
def test_the_groups_along_any_axes_partition_the_world_and_vary_only_those_axes(shape, axes):
    spanned = shape.axes(*axes)
    groups = shape.groups(*axes)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(shape.world_size))
    for color, group in enumerate(groups):
        assert [shape.coord(r, *axes) for r in group] == list(range(shape.size(*axes)))
        assert {shape.color(r, *axes) for r in group} == {color}
        others = {tuple(shape.coords(r)[a] for a in AXES if a not in spanned) for r in group}
        assert len(others) == 1


def test_expert_groups_are_blocks_of_adjacent_dp_ranks_and_expert_dp_their_columns():
    shape = MeshShape(dp=4, ep=2)
    assert shape.groups("ep") == ((0, 1), (2, 3))
    assert shape.groups("edp") == ((0, 2), (1, 3))
    assert shape.groups("dp") == ((0, 1, 2, 3),)


def test_hybrid_shard_groups_are_adjacent_dp_ranks_and_replica_groups_their_columns():
    shape = MeshShape(dp=4, tp=2, shard=2)
    assert shape.groups("zs") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert shape.groups("zr") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert shape.groups("edp") == shape.groups("dp") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert MeshShape(dp=4).sizes["zs"] == 4 and MeshShape(dp=4).sizes["zr"] == 1


def test_a_shard_size_that_does_not_divide_dp_is_refused_naming_the_flag():
    with pytest.raises(TopologyError, match=r"\[--zero-shard-size 3\]: it does not divide the "
                                            r"4 data-parallel ranks"):
        MeshShape(dp=4, shard=3)


def test_infer_gives_dp_as_what_remains_of_the_world():
    assert MeshShape.infer(16, tp=2, pp=4) == MEGATRON


def test_infer_rejects_tp_times_pp_that_does_not_divide_the_world():
    with pytest.raises(TopologyError, match=r"tp=3 x pp=2 = 6 does not divide the world"):
        MeshShape.infer(16, tp=3, pp=2)


def test_layout_for_another_world_size_is_rejected_with_both_numbers():
    with pytest.raises(TopologyError) as err:
        MeshShape(dp=2, tp=2, pp=2).check_world(4)
    assert "[world size 4]" in str(err.value) and "= 8 ranks" in str(err.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_non_positive_or_non_integer_degree_is_rejected_naming_the_option(bad):
    with pytest.raises(TopologyError, match=r"\[--tp\]"):
        MeshShape(dp=1, tp=bad, pp=1)


def test_an_ep_that_does_not_divide_dp_is_rejected():
    with pytest.raises(TopologyError, match=r"\[--ep 2\]: ep=2 does not divide dp=3"):
        MeshShape(dp=3, ep=2)


def test_rank_outside_the_layout_is_rejected():
    with pytest.raises(TopologyError, match=r"rank 16"):
        MEGATRON.coords(16)


def test_coordinates_outside_the_layout_are_rejected():
    with pytest.raises(TopologyError, match=r"pp=4"):
        MEGATRON.rank_of({"pp": 4})


def test_unknown_axis_is_rejected():
    with pytest.raises(TopologyError, match="unknown parallel axis"):
        MEGATRON.groups("sp")


class SplitRecorder:
    """A stand-in world communicator of one rank of ``shape``: a split answers a group whose
    rank is the key and whose size is the number of ranks sharing the color."""

    def __init__(self, shape: MeshShape, rank: int, size: int | None = None,
                 name: str = "world") -> None:
        self.shape, self.rank, self.name = shape, rank, name
        self.size = shape.world_size if size is None else size
        self.splits: list[str] = []

    def split(self, color: int, key: int, *, name: str = "") -> SplitRecorder:
        self.splits.append(name)
        members = [r for r in range(self.shape.world_size)
                   if self.shape.color(r, *name.split("+")) == color]
        return SplitRecorder(self.shape, key, len(members), name)


@pytest.mark.parametrize("rank", range(8))
def test_a_mesh_has_every_group_even_of_one_rank_and_answers_ranks_sizes_and_ends(rank):
    shape = MeshShape(dp=4, tp=2, pp=1, ep=2)
    world = SplitRecorder(shape, rank)
    mesh = Mesh.build(world, shape, torch.device("cpu"))
    # cp 1: the gradients' groups over dp and cp are dp's and edp's, not split again
    assert world.splits == ["tp", "cp", "ep", "zs", "zr", "pp", "edp", "dp"]
    assert ["+".join(g) for g in GROUPS] == [*world.splits, "dp_cp", "edp_cp"]
    assert ["+".join(g) for g in splits(shape)] == world.splits
    assert mesh.group("dp_cp") is mesh.group("dp") and mesh.group("edp_cp") is mesh.group("edp")
    assert mesh.group() is world and mesh.group("tp", "cp", "dp", "pp") is world
    for axis in ("tp", "ep", "edp", "dp", "pp"):
        assert mesh.group(axis).rank == mesh.rank(axis) == shape.coord(rank, axis)
        assert mesh.group(axis).size == mesh.size(axis) == shape.size(axis)
        assert mesh.is_first(axis) == (mesh.rank(axis) == 0)
        assert mesh.is_last(axis) == (mesh.rank(axis) == mesh.size(axis) - 1)
    assert mesh.size("pp") == 1 and mesh.is_first("pp") and mesh.is_last("pp")
    assert mesh.rank() == rank


def test_asking_a_mesh_for_a_group_it_does_not_split_names_the_ones_it_has():
    shape = MeshShape(dp=2, tp=2, pp=2)
    mesh = Mesh.build(SplitRecorder(shape, 0), shape, torch.device("cpu"))
    with pytest.raises(TopologyError, match=r"no such group in the mesh \[tp\+pp\]: the mesh "
                                            r"splits tp, cp, ep, zs, zr, pp, edp, dp, dp_cp, "
                                            r"edp_cp and the world"):
        mesh.group("tp", "pp")


def test_at_cp_2_the_gradients_groups_over_dp_and_cp_are_split_of_their_own():
    shape = MeshShape(dp=2, tp=1, pp=1, cp=2)
    world = SplitRecorder(shape, 3)
    mesh = Mesh.build(world, shape, torch.device("cpu"))
    assert world.splits == ["+".join(g) for g in splits(shape)] == ["+".join(g) for g in GROUPS]
    assert mesh.group("dp_cp").size == 4 and mesh.group("dp").size == 2
