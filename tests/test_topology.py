"""Rank layout tp-dp-pp (TP fastest), checked against Megatron's docstring example."""

from __future__ import annotations

import itertools

import pytest

from trainer.comm.topology import AXES, Coords, ParallelDims
from trainer.errors import TopologyError

# Megatron parallel_state.py docstring: 16 GPUs, TP=2, PP=4, hence DP=2.
MEGATRON = ParallelDims(dp=2, tp=2, pp=4)


def test_megatron_16_gpu_example_tensor_parallel_groups_are_adjacent_pairs():
    assert MEGATRON.groups("tp") == tuple((2 * i, 2 * i + 1) for i in range(8))


def test_megatron_16_gpu_example_data_parallel_groups_stride_by_tp():
    assert MEGATRON.groups("dp") == (
        (0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15))


def test_megatron_16_gpu_example_pipeline_groups_stride_by_tp_times_dp():
    assert MEGATRON.groups("pp") == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))


@pytest.mark.parametrize("dims", [ParallelDims(2, 2, 4), ParallelDims(3, 2, 2),
                                  ParallelDims(1, 4, 1),
                                  ParallelDims(4, 1, 2), ParallelDims(1, 1, 1)])
def test_rank_formula_and_coords_are_inverse_for_every_rank(dims):
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert rank == c.tp + dims.tp * (c.dp + dims.dp * c.pp)
        assert dims.rank_of(c) == rank


@pytest.mark.parametrize("dims", [ParallelDims(2, 2, 4), ParallelDims(3, 2, 2),
                                  ParallelDims(2, 1, 3)])
def test_groups_of_each_axis_partition_the_world_and_vary_only_their_axis(dims):
    for axis in AXES:
        groups = dims.groups(axis)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(dims.world_size))
        for group in groups:
            coords = [dims.coords(r) for r in group]
            assert [c.on(axis) for c in coords] == list(range(dims.size(axis)))
            others = {tuple(c.on(a) for a in AXES if a != axis) for c in coords}
            assert len(others) == 1


def test_group_index_is_the_position_of_the_rank_group_and_shared_by_its_members():
    for axis in AXES:
        for index, group in enumerate(MEGATRON.groups(axis)):
            assert {MEGATRON.group_index(axis, r) for r in group} == {index}
            for r in group:
                assert MEGATRON.group_ranks(axis, r) == group


def test_infer_gives_dp_as_what_remains_of_the_world():
    assert ParallelDims.infer(16, tp=2, pp=4) == MEGATRON


def test_infer_rejects_tp_times_pp_that_does_not_divide_the_world():
    with pytest.raises(TopologyError, match=r"tp=3 x pp=2 = 6 does not divide the world"):
        ParallelDims.infer(16, tp=3, pp=2)


def test_layout_for_another_world_size_is_rejected_with_both_numbers():
    with pytest.raises(TopologyError) as err:
        ParallelDims(dp=2, tp=2, pp=2).check_world(4)
    assert "[world size 4]" in str(err.value) and "= 8 ranks" in str(err.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_non_positive_or_non_integer_degree_is_rejected_naming_the_option(bad):
    with pytest.raises(TopologyError, match=r"\[--tp\]"):
        ParallelDims(dp=1, tp=bad, pp=1)


def test_rank_outside_the_layout_is_rejected():
    with pytest.raises(TopologyError, match=r"rank 16"):
        MEGATRON.coords(16)


def test_coordinates_outside_the_layout_are_rejected():
    with pytest.raises(TopologyError, match=r"pp=4"):
        MEGATRON.rank_of(Coords(tp=0, dp=0, pp=4))


def test_unknown_axis_is_rejected():
    with pytest.raises(TopologyError, match="unknown parallel axis"):
        MEGATRON.groups("ep")
