"""Where every gradient element lives under ZeRO-1, and which of them a DP rank owns.

The contiguous gradient buffer (reverse parameter order, as in `trainer.parallel.data.grad_sync`) is
cut into buckets exactly as without ZeRO, and each bucket is then padded with zeros to a multiple of
dp so that it splits into dp equal, contiguous shards; DP rank r owns shard r of *every* bucket
(Megatron's distributed optimizer does the same). Sharding bucket by bucket is what lets each
bucket be reduce-scattered as soon as backward has filled it, and lets a parameter that must
line up across two layouts (the tied embedding of the first and last pipeline stage) get a
bucket of its own: the same numel and dp then give the same elements to the same rank on both.

A `Piece` is the part of one parameter inside this rank's shards: the optimizer steps pieces.
Everything here is arithmetic on sizes, so it is unit-tested without ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from trainer.parallel.data.buckets import plan_buckets


@dataclass(frozen=True)
class ShardedBucket:
    start: int
    """Buffer offset of the bucket's first element."""
    end: int
    """Buffer offset after its padding: ``end - start`` divides by dp."""
    params: range
    """Indices (in buffer order) of the parameters it holds."""


@dataclass(frozen=True)
class Piece:
    param: int
    """Index of the parameter (buffer order)."""
    lo: int
    hi: int
    """The elements [lo, hi) of the flattened parameter that this rank owns."""
    bucket: int
    at: int
    """Offset of element ``lo`` inside this rank's shard of the bucket."""


@dataclass(frozen=True)
class ShardLayout:
    """The padded buffer of one rank's model and the pieces DP rank ``rank`` of ``dp`` owns."""

    numels: tuple[int, ...]
    dp: int
    rank: int
    buckets: tuple[ShardedBucket, ...]
    offsets: tuple[int, ...]
    """Buffer offset of every parameter."""

    @property
    def size(self) -> int:
        """Elements of the padded buffer."""
        return self.buckets[-1].end if self.buckets else 0

    def shard(self, k: int) -> tuple[int, int]:
        """Buffer range [start, end) of this rank's shard of bucket ``k``."""
        b = self.buckets[k]
        width = (b.end - b.start) // self.dp
        return b.start + self.rank * width, b.start + (self.rank + 1) * width

    def pieces(self) -> list[Piece]:
        """This rank's parts of the parameters, bucket by bucket, in buffer order."""
        out = []
        for k, b in enumerate(self.buckets):
            lo, hi = self.shard(k)
            for i in b.params:
                start = self.offsets[i]
                a, z = max(lo, start), min(hi, start + self.numels[i])
                if a < z:
                    out.append(Piece(i, a - start, z - start, k, a - lo))
        return out


def shard_layout(numels: Sequence[int], bucket_size: int, dp: int, rank: int,
                 alone: Collection[int] = ()) -> ShardLayout:
    """Buckets of about ``bucket_size`` elements (`trainer.parallel.data.buckets.plan_buckets`),
    each padded to a multiple of ``dp``; a parameter index in ``alone`` gets a bucket of its own."""
    runs, first = [], 0
    for i in sorted(alone):  # cut the parameters into runs around the lone ones
        runs += [range(first, i), range(i, i + 1)]
        first = i + 1
    runs.append(range(first, len(numels)))
    buckets, offsets, cursor = [], [0] * len(numels), 0
    for run in (r for r in runs if len(r)):
        for start, end, idx in plan_buckets([numels[i] for i in run], bucket_size):
            params = range(run.start + idx.start, run.start + idx.stop)
            offset = cursor
            for i in params:
                offsets[i], offset = offset, offset + numels[i]
            padded = -(-(end - start) // dp) * dp
            buckets.append(ShardedBucket(cursor, cursor + padded, params))
            cursor += padded
    return ShardLayout(tuple(numels), dp, rank, tuple(buckets), tuple(offsets))


def unit_layout(numels: Sequence[int], units: Sequence[range], dp: int, rank: int
                ) -> ShardLayout:
    """One bucket per unit (ZeRO-3: a run of parameters gathered and reduced together, a
    transformer block, the embedding), each padded to a multiple of ``dp``; ``units`` are
    consecutive ranges covering every parameter index in order."""
    buckets, offsets, cursor = [], [0] * len(numels), 0
    for unit in units:
        offset = cursor
        for i in unit:
            offsets[i], offset = offset, offset + numels[i]
        padded = -(-(offset - cursor) // dp) * dp
        buckets.append(ShardedBucket(cursor, cursor + padded, unit))
        cursor += padded
    return ShardLayout(tuple(numels), dp, rank, tuple(buckets), tuple(offsets))
