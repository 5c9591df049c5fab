"""Rank layout of a 3-D parallel job (pure; no MPI, no torch).

Megatron's order ``tp-dp-pp`` with TP varying fastest, so the ranks of one TP group are adjacent
and land on one host (TP traffic is the heaviest and wants NVLink)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

A group along an axis is every rank that shares the coordinates on the other two axes; its
members are ordered by their coordinate on the axis, so a rank's index inside its TP group is its
``tp_rank``. Groups of one axis are numbered by their lowest member, which is the ``color`` used
to split a communicator into them. Megatron's docstring example (16 GPUs, tp=2, pp=4, dp=2):
TP groups [0,1],[2,3],..., DP groups [0,2],[1,3],[4,6],..., PP groups [0,4,8,12],[1,5,9,13],...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.errors import TopologyError

Axis = Literal["tp", "dp", "pp"]
AXES: tuple[Axis, ...] = ("tp", "dp", "pp")  # fastest-varying first


@dataclass(frozen=True)
class Coords:
    """A rank's position on the three axes."""

    tp: int
    dp: int
    pp: int

    def on(self, axis: Axis) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}[_axis(axis)]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, tensor and pipeline parallelism; their product is the world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(
                    "invalid parallel layout", f"--{axis}",
                    f"{axis}={value!r} is not a positive integer",
                    f"Pass --{axis} 1 or more",
                )

    @classmethod
    def infer(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> ParallelDims:
        """Megatron's rule: dp is what remains of the world after tp and pp."""
        if world_size % (tp * pp):
            raise TopologyError(
                "invalid parallel layout", f"world size {world_size}",
                f"tp={tp} x pp={pp} = {tp * pp} does not divide the world",
                "Choose tp and pp whose product divides the number of ranks",
            )
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def size(self, axis: Axis) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}[_axis(axis)]

    def stride(self, axis: Axis) -> int:
        return {"tp": 1, "dp": self.tp, "pp": self.tp * self.dp}[_axis(axis)]

    def check_world(self, world_size: int) -> ParallelDims:
        """Raise unless the layout uses exactly ``world_size`` ranks; returns self."""
        if self.world_size != world_size:
            raise TopologyError(
                "parallel layout does not fit the job", f"world size {world_size}",
                f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} ranks",
                f"Launch {self.world_size} ranks, or choose dp*tp*pp = {world_size}",
            )
        return self

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        return Coords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp,
                      pp=rank // (self.tp * self.dp))

    def rank_of(self, coords: Coords) -> int:
        for axis in AXES:
            if not 0 <= coords.on(axis) < self.size(axis):
                raise TopologyError(
                    "coordinates outside the layout", f"{axis}={coords.on(axis)}",
                    f"{axis} ranks run from 0 to {self.size(axis) - 1}", "Pass a valid coordinate",
                )
        return coords.tp + self.tp * (coords.dp + self.dp * coords.pp)

    def group_ranks(self, axis: Axis, rank: int) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group along ``axis``, ordered by their axis coordinate."""
        stride = self.stride(axis)
        base = rank - self.coords(rank).on(axis) * stride
        return tuple(base + i * stride for i in range(self.size(axis)))

    def groups(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axis``, numbered (ordered) by their lowest rank."""
        return tuple(
            self.group_ranks(axis, r) for r in range(self.world_size)
            if self.coords(r).on(axis) == 0
        )

    def group_index(self, axis: Axis, rank: int) -> int:
        """The number of ``rank``'s group among ``groups(axis)``: the split color."""
        return self.groups(axis).index(self.group_ranks(axis, rank))

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(
                "rank outside the layout", f"rank {rank!r}",
                f"dp={self.dp} x tp={self.tp} x pp={self.pp} has ranks 0..{self.world_size - 1}",
                "Check the layout against the world size",
            )


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise TopologyError(
            "unknown parallel axis", repr(axis), "the axes are tp, dp and pp", "Use one of them"
        )
    return axis
