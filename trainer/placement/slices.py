"""Which part of a global tensor one rank holds, as numbers: the `Placement` of a tensor, and
the copies that move data between two placements of the same tensor (pure; no torch).

A tensor of the serial model (its *global* name and shape) is held by a rank as a *slice*:

* ``tp``: cut along one dimension over the TP group (`TPSplit`: dim, stride, rank, size).
  With stride s the dimension is first cut into s equal parts, each cut over the group, and
  the rank holds part k's block for every k, in order: the fused qkv weight ``[q; k; v]`` has
  stride 3. None: the whole tensor (the rank is one of its TP replicas, or tp = 1).
* ``flat``: then, ZeRO-1, only the elements [lo, hi) of that slice flattened (None: all).

The rank's data is the slice's elements in its own row-major order. In the global tensor's
row-major order those elements are a few *runs* of consecutive elements (`runs`), so the
overlap of any two placements of one tensor (what a saved piece holds of what a rank needs) is
the overlap of two sorted lists of runs (`copies`, rows at fixed steps joined into one strided
copy). A tensor whose saved shape has fewer
rows than the rank's (the vocabulary padded to another multiple of tp) overlaps in the rows
both have: their flat indices are the same.

Where the slice sits on the mesh (the pipeline stage: by the global layer index in the name;
the experts: by the expert index in the name) needs no field; ``replicated`` names the axes
along which other ranks hold the same slice, and ``copy`` marks a copy of a tensor another
pipeline stage owns (the tied head on the last stage), never saved and never counted twice.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class TPSplit:
    """A tensor cut over the TP group: along ``dim``, in ``stride`` interleaved parts, the
    block of ``rank`` of ``size``."""

    dim: int
    stride: int
    rank: int
    size: int


@dataclass(frozen=True)
class Placement:
    """One rank's slice of one global tensor (module docstring)."""

    name: str
    shape: tuple[int, ...]
    tp: TPSplit | None = None
    flat: tuple[int, int] | None = None
    replicated: tuple[str, ...] = ()
    copy: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the rank's tensor before ``flat`` (the TP shard's)."""
        if self.tp is None:
            return self.shape
        dims = list(self.shape)
        dims[self.tp.dim] //= self.tp.size
        return tuple(dims)

    @property
    def numel(self) -> int:
        """Elements the rank holds."""
        return self.flat[1] - self.flat[0] if self.flat else math.prod(self.local_shape)

    def piece(self, lo: int, hi: int, *, over: tuple[str, ...]) -> Placement:
        """The elements [lo, hi) of this slice, flattened: a ZeRO-1 piece, which each rank of
        the axes ``over`` holds a different one of (so it is no replica along them)."""
        base = self.flat[0] if self.flat else 0
        return replace(self, flat=(base + lo, base + hi),
                       replicated=tuple(a for a in self.replicated if a not in over))

    def to_json(self) -> dict[str, Any]:
        """The slice as a checkpoint's index records it."""
        tp = self.tp
        return {"name": self.name, "shape": list(self.shape),
                "tp": [tp.dim, tp.stride, tp.rank, tp.size] if tp else None,
                "flat": list(self.flat) if self.flat else None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Placement:
        tp = TPSplit(*(int(x) for x in d["tp"])) if d.get("tp") else None
        flat = (int(d["flat"][0]), int(d["flat"][1])) if d.get("flat") else None
        return cls(str(d["name"]), tuple(int(x) for x in d["shape"]), tp, flat)


Runs = tuple[list[int], list[int]]
"""(starts, lengths) of consecutive elements in the global row-major order, in the order the
slice's own data holds them (ascending)."""


def runs(p: Placement) -> Runs:
    """Where the slice's elements lie in the global tensor (see `Runs`)."""
    starts, lengths = _tp_runs(p)
    if p.flat is None:
        return starts, lengths
    return _cut(starts, lengths, *p.flat)


def _tp_runs(p: Placement) -> Runs:
    if p.tp is None:
        return [0], [math.prod(p.shape)]
    d, s, r, n = p.tp.dim, p.tp.stride, p.tp.rank, p.tp.size
    outer, size, inner = math.prod(p.shape[:d]), p.shape[d], math.prod(p.shape[d + 1:])
    block = size // (s * n)
    starts = [(o * size + k * (size // s) + r * block) * inner
              for o in range(outer) for k in range(s)]
    return starts, [block * inner] * len(starts)


def _cut(starts: list[int], lengths: list[int], lo: int, hi: int) -> Runs:
    """The runs of the slice's flattened elements [lo, hi)."""
    out_s, out_l, at = [], [], 0
    for start, length in zip(starts, lengths, strict=True):
        a, z = max(lo, at), min(hi, at + length)
        if a < z:
            out_s.append(start + a - at)
            out_l.append(z - a)
        at += length
        if at >= hi:
            break
    return out_s, out_l


@dataclass(frozen=True)
class Copy:
    """``count`` moves of ``n`` elements, both sides flat: move i is ``dst[dst_at + i *
    dst_step:][:n] = src[src_at + i * src_step:][:n]``. A slice cut along an inner dimension
    is one run per row, and the rows of two such slices meet at fixed steps: one `Copy` says
    it for every row (a strided copy), where a list of rows would grow with the tensor."""

    dst_at: int
    src_at: int
    n: int
    count: int = 1
    dst_step: int = 0
    src_step: int = 0

    @property
    def elements(self) -> int:
        return self.n * self.count

    @property
    def src_end(self) -> int:
        """One past the last source element read."""
        return self.src_at + (self.count - 1) * self.src_step + self.n

    def each(self) -> list[tuple[int, int, int]]:
        """(dst_at, src_at, n) of every move."""
        return [(self.dst_at + i * self.dst_step, self.src_at + i * self.src_step, self.n)
                for i in range(self.count)]


def copies(wanted: Placement, saved: Placement, limit: int | None = None) -> list[Copy]:
    """What of ``saved``'s data fills which part of ``wanted``'s (empty: no overlap), merged
    where both sides are contiguous. ``limit``: the end of the global flat range both have
    (the fewer rows of two padded vocabularies)."""
    ws, wl = runs(wanted)
    vs, vl = runs(saved)
    v_end = [s + n for s, n in zip(vs, vl, strict=True)]
    v_at = _offsets(vl)
    out: list[Copy] = []
    for w_start, w_len, w_at in zip(ws, wl, _offsets(wl), strict=True):
        w_end = w_start + w_len if limit is None else min(w_start + w_len, limit)
        for j in range(bisect_right(v_end, w_start), bisect_left(vs, w_end)):
            a, z = max(w_start, vs[j]), min(w_end, v_end[j])
            if a < z:
                _append(out, Copy(w_at + a - w_start, v_at[j] + a - vs[j], z - a))
    return out


def _offsets(lengths: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _append(out: list[Copy], c: Copy) -> None:
    """Add the single move ``c``: joined to the last move when both sides continue it, or
    to the last strided copy when it is that copy's next row."""
    last = out[-1] if out else None
    if last is None or last.n != c.n and last.count > 1:
        out.append(c)
    elif last.count == 1 and last.dst_at + last.n == c.dst_at and last.src_at + last.n == c.src_at:
        out[-1] = Copy(last.dst_at, last.src_at, last.n + c.n)
    elif last.n == c.n and last.count == 1:
        out[-1] = Copy(last.dst_at, last.src_at, c.n, 2, c.dst_at - last.dst_at,
                       c.src_at - last.src_at)
    elif (last.n == c.n and c.dst_at == last.dst_at + last.count * last.dst_step
          and c.src_at == last.src_at + last.count * last.src_step):
        out[-1] = replace(last, count=last.count + 1)
    else:
        out.append(c)
