"""Placements as numbers: the runs of a slice are where torch's own cut puts its elements, the
copies between two placements rebuild one from the other exactly, every slice has one writer
and is counted once in a world-wide sum, and parameters get their placement from what each
feature left on them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trainer.comm.topology import MeshShape
from trainer.parallel.tensor.sharding import ShardSpec, shard_tensor
from trainer.placement import Placement, TPSplit, copies, leads, runs, writers


class At:
    """The answers of a `trainer.comm.mesh.Mesh` at one rank of ``shape``, without groups."""

    def __init__(self, shape: MeshShape, rank: int) -> None:
        self.shape, self._rank = shape, rank

    def rank(self, *axes: str) -> int:
        return self.shape.coord(self._rank, *axes) if axes else self._rank

    def size(self, *axes: str) -> int:
        return self.shape.size(*axes)


def held(p: Placement, full: torch.Tensor) -> torch.Tensor:
    """What a rank with placement ``p`` holds of ``full``, cut the way torch's code does."""
    local = full if p.tp is None else shard_tensor(full, p.tp.rank, p.tp.size,
                                                   ShardSpec(p.tp.dim, p.tp.stride))
    flat = local.reshape(-1)
    return flat[p.flat[0]:p.flat[1]] if p.flat else flat


CUTS = [((12, 8), 0, 1, 2), ((12, 8), 0, 3, 2), ((24, 4), 0, 3, 4), ((6, 8), 1, 1, 2),
        ((6, 8), 1, 1, 4), ((4, 6, 8), 1, 3, 2), ((16,), 0, 1, 4)]


@pytest.mark.parametrize(("shape", "dim", "stride", "size"), CUTS)
def test_the_runs_of_a_tp_slice_and_its_flat_ranges_are_where_torch_cuts_them(
        shape, dim, stride, size) -> None:
    full = torch.arange(math.prod(shape)).reshape(shape)
    for rank in range(size):
        p = Placement("w", shape, TPSplit(dim, stride, rank, size))
        numel = p.numel
        for lo, hi in ((0, numel), (1, numel - 1), (numel // 3, numel // 2)):
            piece = p.piece(lo, hi, over=())
            starts, lengths = runs(piece)
            at = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths,
                                                                    strict=True)])
            assert torch.equal(at, held(piece, full))


PLACEMENTS = [Placement("w", (12, 8)), Placement("w", (12, 8), flat=(5, 70)),
              *(Placement("w", (12, 8), TPSplit(0, 3, r, 2)) for r in range(2)),
              *(Placement("w", (12, 8), TPSplit(1, 1, r, 4)) for r in range(4)),
              Placement("w", (12, 8), TPSplit(1, 1, 1, 2), flat=(3, 41))]


@pytest.mark.parametrize(("want", "have"), list(itertools.product(PLACEMENTS, PLACEMENTS)))
def test_the_copies_between_two_placements_move_exactly_the_overlap(want, have) -> None:
    full = torch.arange(96.0).reshape(12, 8)
    got = torch.full((want.numel,), -1.0)
    source = held(have, full)
    for c in copies(want, have):
        for dst, src, n in c.each():
            got[dst:dst + n] = source[src:src + n]
    expected = held(want, full)
    mine, theirs = set(held(want, full).tolist()), set(source.tolist())
    assert torch.equal(got == expected, torch.tensor([v in theirs for v in expected.tolist()]))
    assert int((got >= 0).sum()) == len(mine & theirs)


def test_slices_of_every_layout_rebuild_the_tensor_when_put_together() -> None:
    full = torch.arange(96.0).reshape(12, 8)
    saved = [Placement("w", (12, 8), TPSplit(0, 3, r, 2)).piece(lo, hi, over=())
             for r in range(2) for lo, hi in ((0, 17), (17, 48))]
    for want in PLACEMENTS:
        got = torch.zeros(want.numel)
        for have in saved:
            for c in copies(want, have):
                for dst, src, n in c.each():
                    got[dst:dst + n] = held(have, full)[src:src + n]
        assert torch.equal(got, held(want, full)), want


def test_a_vocabulary_padded_to_more_rows_takes_the_rows_the_checkpoint_has() -> None:
    saved, want = Placement("emb", (8, 4)), Placement("emb", (12, 4), TPSplit(0, 1, 1, 2))
    moves = copies(want, saved, limit=8 * 4)
    assert [(c.dst_at, c.src_at, c.n) for c in moves] == [(0, 24, 8)]  # rows 6, 7 of 6..11


def test_the_rows_of_a_slice_cut_along_an_inner_dimension_move_as_one_strided_copy() -> None:
    """A row-parallel weight saved at tp 4 and read whole: one copy per saved piece however
    many rows the tensor has, each moving every row at fixed steps."""
    want = Placement("proj", (4096, 64))
    for r in range(4):
        [c] = copies(want, Placement("proj", (4096, 64), TPSplit(1, 1, r, 4)))
        assert (c.dst_at, c.src_at, c.n, c.count, c.dst_step, c.src_step) == \
            (16 * r, 0, 16, 4096, 64, 16)


@pytest.mark.parametrize("shape", [MeshShape(dp=4, tp=2), MeshShape(dp=2, tp=2, pp=2),
                                   MeshShape(dp=4, ep=2)])
def test_every_slice_has_exactly_one_writer_and_is_counted_once_and_writes_are_spread(
        shape) -> None:
    names = [("big", 400), ("mid", 300), ("small", 50), ("tiny", 10)]
    written: dict[tuple, int] = {}
    counted: dict[tuple, int] = {}
    load = [0] * shape.world_size
    for rank in range(shape.world_size):
        at = At(shape, rank)
        tp, ep, stage = at.rank("tp"), at.rank("ep"), at.rank("pp")
        # this stage's dense slices, replicated over DP (and TP for the replicated ones), and
        # one expert of each EP member
        held_here = [Placement(f"{n}{stage}", (k,), replicated=("ep", "edp", "tp"))
                     for n, k in names]
        held_here += [Placement(f"{n}{stage}-tp", (k,), TPSplit(0, 1, tp, shape.tp),
                                replicated=("ep", "edp")) for n, k in names if shape.tp > 1]
        held_here += [Placement(f"expert{ep}@{stage}", (64,), replicated=("edp", "tp"))]
        held_here += [Placement("copy", (8,), replicated=("ep", "edp", "tp"), copy=True)]
        for p, mine in zip(held_here, writers(held_here, at), strict=True):
            key = (p.name, p.tp.rank if p.tp else None)
            written[key] = written.get(key, 0) + mine
            counted[key] = counted.get(key, 0) + leads(p, at)
            load[rank] += p.numel if mine else 0
    assert written.pop(("copy", None)) == 0 and counted.pop(("copy", None)) == 0
    assert set(written.values()) == {1} and set(counted.values()) == {1}
    # Spread: every rank writes, none more than its share and the largest slice.
    assert min(load) > 0 and max(load) <= sum(load) / len(load) + 400, load
