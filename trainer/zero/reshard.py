"""Re-sharding ZeRO-1 optimizer state: which saved shard holds which elements of a parameter.

A ZeRO-1 checkpoint (`trainer.zero.state`) has, per (tp, pp) stage, one index and one file per
DP rank. The index (`FlatIndex`) is the saved flat layout: every parameter's name, shape and
offset in the padded gradient buffer, the buckets, and the dp it was cut for. DP rank r's file
holds its shard of every bucket, concatenated in bucket order. A run at another dp (or with
another bucket size) asks for its own pieces as (parameter name, first element, end element)
and `plan_reads` says which saved files hold them and where: a rank opens only those files.
Everything here is arithmetic on the index, so it is unit-tested without ranks or files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.zero.layout import ShardLayout

INDEX_FORMAT = 1


@dataclass(frozen=True)
class FlatIndex:
    """The flat layout of one (tp, pp) stage's padded buffer, as saved."""

    dp: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]
    """[start, end) of every bucket in the padded buffer; end - start divides by dp."""

    @property
    def padded(self) -> int:
        """Elements of the padded buffer."""
        return self.buckets[-1][1] if self.buckets else 0

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """The buffer ranges DP rank ``rank``'s file holds (its shard of each bucket)."""
        return [(a + rank * (z - a) // self.dp, a + (rank + 1) * (z - a) // self.dp)
                for a, z in self.buckets]

    def to_dict(self) -> dict[str, Any]:
        return {"format": INDEX_FORMAT, "dp": self.dp, "padded": self.padded,
                "names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "offsets": list(self.offsets), "buckets": [list(b) for b in self.buckets],
                "ranges": [self.ranges(r) for r in range(self.dp)]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FlatIndex:
        return cls(int(d["dp"]), tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]),
                   tuple(d["offsets"]), tuple((int(a), int(z)) for a, z in d["buckets"]))

    @classmethod
    def of(cls, layout: ShardLayout, names: Sequence[str],
           shapes: Sequence[tuple[int, ...]]) -> FlatIndex:
        """The index of a run's `ShardLayout` (``names``/``shapes`` in buffer order)."""
        return cls(layout.dp, tuple(names), tuple(tuple(s) for s in shapes), layout.offsets,
                   tuple((b.start, b.end) for b in layout.buckets))


@dataclass(frozen=True)
class Read:
    """Copy ``file[src:src + n]`` of saved DP rank ``rank`` into ``piece[dst:dst + n]``."""

    piece: int
    rank: int
    src: int
    dst: int
    n: int


def plan_reads(index: FlatIndex, wanted: Sequence[tuple[str, int, int]]) -> list[Read]:
    """The copies that assemble each wanted (name, lo, hi) piece from the saved files.
    Raises KeyError for a name the index lacks (the caller checks the layouts first)."""
    where = {name: i for i, name in enumerate(index.names)}
    width = [(z - a) // index.dp for a, z in index.buckets]
    before = [sum(width[:k]) for k in range(len(width))]  # file offset of each bucket's shard
    reads = []
    for n, (name, lo, hi) in enumerate(wanted):
        i = where[name]
        first, last = index.offsets[i] + lo, index.offsets[i] + hi
        k = next(k for k, (a, z) in enumerate(index.buckets) if a <= first < z)
        start, w = index.buckets[k][0], width[k]
        for rank in range((first - start) // w, (last - 1 - start) // w + 1):
            a = max(first, start + rank * w)
            z = min(last, start + (rank + 1) * w)
            reads.append(Read(n, rank, before[k] + a - start - rank * w, a - first, z - a))
    return reads


def layout_differences(saved: FlatIndex, names: Sequence[str],
                       shapes: Sequence[tuple[int, ...]]) -> list[str]:
    """How this run's parameters differ from the saved ones (empty: they match)."""
    had = dict(zip(saved.names, saved.shapes, strict=True))
    now = dict(zip(names, (tuple(s) for s in shapes), strict=True))
    diffs = [f"{n}: checkpoint {list(had[n])}, now {list(s)}" for n, s in now.items()
             if n in had and had[n] != s]
    diffs += [f"{n}: not in the checkpoint" for n in now if n not in had]
    diffs += [f"{n}: only in the checkpoint" for n in had if n not in now]
    return diffs
