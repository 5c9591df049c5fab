"""The shape of a parallel job: named axes and their rank arithmetic (pure; no MPI, no torch).

Five axes, fastest-varying first: ``tp``, ``cp``, ``ep``, ``edp``, ``pp`` (edp itself split in
two, ``zs`` and ``zr``, for ZeRO's hybrid sharding, `AXES`). Data parallelism is the pair
``dp = (ep, edp)``: its ranks are cut into blocks of ``ep`` adjacent ranks (the expert-parallel
groups of `trainer.parallel.expert`), and the ranks at the same place in every block form the
expert-data-parallel group ``edp``. A dense model has ep = 1, so edp is all of dp.
Megatron-core's order ``tp-cp-ep-dp-pp`` follows, with TP varying fastest so the ranks of one TP
group are adjacent and land on one host (TP traffic is the heaviest and wants NVLink), and the
context-parallel group (`trainer.parallel.context`: one sequence split over cp ranks, K/V passed
around a ring every layer) next to it, the second-heaviest traffic. Llama 3's [tp, cp, pp, dp]
differs only in where pp sits; cp = 1 leaves every rank where it was before the axis existed::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
    dp_rank = ep_rank + ep * edp_rank

The parameters are the same on every cp rank (cp splits tokens, not weights), so a gradient is
reduced over dp and cp together: the spans ``dp_cp`` (dense weights) and ``edp_cp`` (experts).

A group along some axes is every rank that shares its coordinates on the other axes; its
members are ordered by their index along those axes (mixed radix, fastest axis first), so a
rank's index in its TP group is its tp rank. The groups of one set of axes are numbered the
same way by the coordinates they do not span: that number is the ``color`` a communicator is
split by. Megatron's docstring example (16 GPUs, tp=2, pp=4, dp=2): TP groups [0,1],[2,3],...,
DP groups [0,2],[1,3],[4,6],..., PP groups [0,4,8,12],[1,5,9,13],...

A new axis is a new entry of `AXES` and of `MeshShape`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import TopologyError

AXES: tuple[str, ...] = ("tp", "cp", "ep", "zs", "zr", "pp")
"""The primitive axes, fastest-varying first. ``edp`` is itself the pair ``(zs, zr)``:
hybrid sharding (``--zero-shard-size N``, any ZeRO stage) shards over ``zs``, N adjacent edp
ranks (one host, say), and replicates it over ``zr``, the ranks at the same place in every
such group; without it zs is all of edp and zr has size 1."""
SPANS: dict[str, tuple[str, ...]] = {"edp": ("zs", "zr"), "dp": ("ep", "zs", "zr"),
                                     "dp_cp": ("cp", "ep", "zs", "zr"),
                                     "edp_cp": ("cp", "zs", "zr"), "world": AXES}
"""Names for several primitive axes at once."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of data, tensor, pipeline, expert and context parallelism; dp * tp * pp * cp
    ranks in all."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """The expert-parallel sub-axis of dp (divides it)."""
    shard: int = 0
    """ZeRO's shard group (hybrid sharding): this many adjacent edp ranks (divides dp / ep);
    0: all of edp."""
    cp: int = 1
    """Context parallelism: the ranks one sequence is split over."""

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep", "cp"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError("invalid parallel layout", f"--{axis}",
                                    f"{axis}={value!r} is not a positive integer",
                                    f"Pass --{axis} 1 or more")
        if self.dp % self.ep:
            raise TopologyError("invalid parallel layout", f"--ep {self.ep}",
                                f"ep={self.ep} does not divide dp={self.dp}",
                                "Choose an ep that divides the number of DP ranks")
        if self.shard < 0 or (self.shard and (self.dp // self.ep) % self.shard):
            raise TopologyError("invalid parallel layout", f"--zero-shard-size {self.shard}",
                                f"it does not divide the {self.dp // self.ep} data-parallel "
                                "ranks that shard each parameter",
                                f"Choose a shard size that divides {self.dp // self.ep}")

    @classmethod
    def infer(cls, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1,
              cp: int = 1) -> MeshShape:
        """Megatron's rule: dp is what remains of the world after tp, cp and pp."""
        if world_size % (tp * pp * cp):
            raise TopologyError(
                "invalid parallel layout", f"world size {world_size}",
                f"tp={tp} x pp={pp}{f' x cp={cp}' if cp > 1 else ''} = {tp * cp * pp} does not "
                "divide the world",
                "Choose tp, cp and pp whose product divides the number of ranks",
            )
        return cls(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every primitive axis."""
        edp = self.dp // self.ep
        zs = self.shard or edp
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "zs": zs, "zr": edp // zs,
                "pp": self.pp}

    def axes(self, *names: str) -> tuple[str, ...]:
        """The primitive axes the names cover, in `AXES` order (no name: the world)."""
        wanted: set[str] = set()
        for name in names or ("world",):
            if name not in AXES and name not in SPANS:
                raise TopologyError("unknown parallel axis", repr(name),
                                    f"the axes are {', '.join((*AXES, *SPANS))}", "Use one of them")
            wanted.update(SPANS.get(name, (name,)))
        return tuple(a for a in AXES if a in wanted)

    def size(self, *names: str) -> int:
        sizes = self.sizes
        return math.prod(sizes[a] for a in self.axes(*names))

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every primitive axis."""
        self._check_rank(rank)
        out = {}
        for axis, size in self.sizes.items():
            rank, out[axis] = divmod(rank, size)
        return out

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (primitive axes; a missing axis is 0)."""
        rank, stride = 0, 1
        for axis, size in self.sizes.items():
            at = coords.get(axis, 0)
            if not 0 <= at < size:
                raise TopologyError("coordinates outside the layout", f"{axis}={at}",
                                    f"{axis} ranks run from 0 to {size - 1}",
                                    "Pass a valid coordinate")
            rank, stride = rank + at * stride, stride * size
        return rank

    def coord(self, rank: int, *names: str) -> int:
        """``rank``'s index in its group along ``names`` (mixed radix, fastest axis first)."""
        return self._index(self.coords(rank), self.axes(*names))

    def color(self, rank: int, *names: str) -> int:
        """The number of ``rank``'s group along ``names`` among all such groups."""
        spanned = self.axes(*names)
        return self._index(self.coords(rank), tuple(a for a in AXES if a not in spanned))

    def group_ranks(self, rank: int, *names: str) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group along ``names``, ordered by their index in it."""
        spanned, base = self.axes(*names), self.coords(rank)
        out = []
        for i in range(self.size(*names)):
            at = dict(base)
            for axis in spanned:
                i, at[axis] = divmod(i, self.sizes[axis])
            out.append(self.rank_of(at))
        return tuple(out)

    def groups(self, *names: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``names``, in color order."""
        firsts = {self.color(r, *names): r for r in range(self.world_size)
                  if self.coord(r, *names) == 0}
        return tuple(self.group_ranks(firsts[c], *names) for c in sorted(firsts))

    def check_world(self, world_size: int) -> MeshShape:
        """Raise unless the layout uses exactly ``world_size`` ranks; returns self."""
        if self.world_size != world_size:
            raise TopologyError(
                "parallel layout does not fit the job", f"world size {world_size}",
                f"{self._product()} = {self.world_size} ranks",
                f"Launch {self.world_size} ranks, or choose dp*tp*pp*cp = {world_size}",
            )
        return self

    def _product(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp} x tp={self.tp} x pp={self.pp}{cp}"

    def _index(self, coords: Mapping[str, int], axes: tuple[str, ...]) -> int:
        index, stride = 0, 1
        for axis in axes:
            index, stride = index + coords[axis] * stride, stride * self.sizes[axis]
        return index

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or \
                not 0 <= rank < self.world_size:
            raise TopologyError(
                "rank outside the layout", f"rank {rank!r}",
                f"{self._product()} has ranks 0..{self.world_size - 1}",
                "Check the layout against the world size",
            )
