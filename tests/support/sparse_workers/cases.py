"""Lookup cases shared by the MPI ranks and the serial ``nn.EmbeddingBag`` reference.

Each case gives every rank of a G-rank world its own bags of keys, a function of (case, rank,
G) alone, so the test can rebuild every rank's input and run them all through one serial table.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

NUM_ROWS = 23  # identity-mode rows: no G in {2, 3, 4} divides it
DIM = 4
SEED = 5
HASH_CAPACITY = 16  # rows per rank in hash mode
HASH_POOL = 10  # distinct raw keys of the hash case
OPT_STEPS = 3
LR = 0.1
INIT_SCALE = 0.05


@dataclass(frozen=True)
class Bags:
    keys: torch.Tensor
    offsets: torch.Tensor
    combiner: str = "sum"


def _gen(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _tag(case: str) -> int:
    return zlib.crc32(case.encode())


def _multi_hot(keys: torch.Tensor, gen: torch.Generator, combiner: str) -> Bags:
    """Bags of 0-3 keys (at least one empty bag) over ``keys``."""
    lengths, total = [0], 0
    while total < len(keys):
        n = int(torch.randint(0, 4, (1,), generator=gen))
        lengths.append(min(n, len(keys) - total))
        total += lengths[-1]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return Bags(keys, starts, combiner)


def hash_pool() -> torch.Tensor:
    """The raw int64 keys of the hash case: far beyond any table, negative ones included."""
    return torch.randint(-2**40, 2**40, (HASH_POOL,), generator=_gen(99))


def bags(case: str, rank: int, size: int, step: int = 0) -> Bags:
    gen = _gen(_tag(case), rank, size, step)
    if case in ("one_hot", "opt"):
        keys = torch.randint(0, NUM_ROWS, (6 + rank,), generator=gen)
        return Bags(keys, torch.arange(len(keys))) if case == "one_hot" else \
            _multi_hot(keys, gen, "sum")
    if case == "one_owner":  # every key of every rank belongs to the last rank
        j = torch.randint(0, (NUM_ROWS - size) // size + 1, (5,), generator=gen)
        keys = size - 1 + size * j
        return Bags(keys, torch.arange(len(keys)))
    if case == "empty_buckets":  # rank 0 sends nothing; nobody sends rank 0 anything
        if rank == 0:
            return Bags(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        keys = torch.randint(0, NUM_ROWS, (8,), generator=gen)
        keys = keys[keys % size != 0] if size > 1 else keys
        return Bags(keys, torch.arange(len(keys)))
    if case == "duplicates":
        keys = torch.tensor([3, 7, 3, 3, 7, 3, 20, 3])
        return _multi_hot(keys, gen, "sum")
    if case in ("multi_hot_sum", "multi_hot_mean"):
        keys = torch.randint(0, NUM_ROWS, (12,), generator=gen)
        return _multi_hot(keys, gen, case.rsplit("_", 1)[1])
    if case == "hash":
        pick = torch.randint(0, HASH_POOL, (9,), generator=gen)
        return _multi_hot(hash_pool()[pick], gen, "mean")
    raise KeyError(case)


LOOKUP_CASES = ("one_hot", "one_owner", "empty_buckets", "duplicates", "multi_hot_sum",
                "multi_hot_mean", "hash")


def cotangent(case: str, rank: int, n_bags: int, step: int = 0) -> torch.Tensor:
    """d(loss)/d(pooled output) of a rank: the loss is Σ (pooled * cotangent) over all ranks."""
    return torch.randn(n_bags, DIM, generator=_gen(_tag(case), rank, 7, step),
                       dtype=torch.float64)
