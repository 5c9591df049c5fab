"""Pure key arithmetic of the sharded embedding: owners, routing plans and per-key initial rows.

Routing (the seed's input dispatcher, step 1): keys are bucketed by owner with a *stable* sort,
so ``order`` lists the positions of the keys sent to rank 0, then rank 1, ...; ``splits[i]``
says how many go to rank i. The output dispatcher restores the input order with the same
``order`` (``out[order] = received``), and the backward exchange reuses the plan in reverse.

Initial rows are a counter-based hash of (seed, key, column), not a draw from a generator, so a
key's row is the same whatever the number of ranks, whichever rank owns it and whenever a hash
table inserts it: a sharded table starts bit-identical to the serial one, and no rank ever
generates (or holds) the whole table. The hash is 32-bit integer mixing done in int64 with every
product kept below 2**63, so it is exact on any CPU or GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (Chris Wellons' hash-prospector)
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without an int64 overflow (c split in halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer of int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def key_hash(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """A 32-bit hash (as int64 in [0, 2**32)) of int64 keys, both halves of each key mixed in."""
    lo, hi = keys & _M32, (keys >> 32) & _M32
    return mix32(mix32(lo ^ (salt & _M32)) ^ mix32(hi ^ _GOLDEN))


def init_rows(keys: torch.Tensor, dim: int, *, seed: int, scale: float,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial rows of ``keys``: uniform in [-scale, scale), a pure function of (seed, key,
    column), shape ``(len(keys), dim)``."""
    base = key_hash(keys, seed).unsqueeze(1)
    cols = torch.arange(dim, dtype=torch.int64, device=keys.device).unsqueeze(0)
    bits = mix32(base ^ mix32(cols * 2 + 1)) >> 8  # 24 random bits: exact in fp32
    unit = bits.to(torch.float64) / float(1 << 24)
    return ((2.0 * unit - 1.0) * scale).to(dtype)


def owners(keys: torch.Tensor, size: int) -> torch.Tensor:
    """The rank that owns each key: key mod size (non-negative for negative keys too)."""
    return torch.remainder(keys, size)


@dataclass(frozen=True)
class Routing:
    """Where this rank's keys go: ``order`` (positions, grouped by owner rank, stable) and
    ``splits`` (how many go to each rank, as Python ints for the all-to-all)."""

    order: torch.Tensor
    splits: list[int]

    @property
    def count(self) -> int:
        return len(self.order)


def route(keys: torch.Tensor, size: int) -> Routing:
    """Bucket ``keys`` by owner, remembering their positions (the seed's dispatcher step 1)."""
    owner = owners(keys, size)
    order = torch.sort(owner, stable=True).indices
    splits = torch.bincount(owner, minlength=size)
    return Routing(order, [int(n) for n in splits.tolist()])


def restore(sent_order: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Rows that came back in owner order, put back in the keys' original order."""
    out = torch.empty_like(received)
    out[sent_order] = received
    return out
