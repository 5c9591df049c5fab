"""Open-addressing key -> row index of one rank's shard in hash mode (linear probing).

Slot i of the table is local row i, so the index is two tensors, ``slot_keys`` and ``used``,
and a lookup of a whole batch is vectorised: all pending keys probe one slot per round. In
training a missing key is inserted (get-or-insert); when several new keys race for the same
empty slot the smallest key wins and the others probe on, so the layout depends only on the
keys seen, in order, and a checkpointed index resumes bit-exactly. In evaluation (get-only) a
missing key maps to row -1, which the table reads as a zero vector. Inserting more distinct keys
than the capacity fails with `SparseError`, before any slot is written.
"""

from __future__ import annotations

import torch

from trainer.errors import TrainerError
from trainer.sparse.keys import key_hash

_SALT = 0x5EED_0001  # the slot hash differs from the init hash (another salt)


class SparseError(TrainerError):
    """A sharded embedding got keys it cannot hold or look up."""


class KeyIndex:
    """get-or-insert / get-only map from int64 keys to rows ``0 .. capacity-1``."""

    def __init__(self, capacity: int, *, where: str, device: torch.device | None = None) -> None:
        if capacity < 1:
            raise SparseError("hash table has no room", where,
                              f"capacity {capacity} per rank", "Give a capacity of at least 1")
        self.capacity, self.where = capacity, where
        self.slot_keys = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.used = torch.zeros(capacity, dtype=torch.bool, device=device)

    @property
    def size(self) -> int:
        return int(self.used.sum())

    def rows(self, keys: torch.Tensor, *, insert: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` (-1: absent, get-only) and the rows inserted by this call."""
        uniq, inverse = torch.unique(keys, return_inverse=True)
        found = self._probe(uniq, insert=False)
        new = torch.empty(0, dtype=torch.int64, device=keys.device)
        if insert and bool((found < 0).any()):
            missing = uniq[found < 0]
            if self.size + len(missing) > self.capacity:
                raise SparseError(
                    "embedding hash table is full", self.where,
                    f"{self.size:,} keys held, {len(missing):,} new keys in this batch, capacity "
                    f"{self.capacity:,} rows per rank",
                    "Raise the hash capacity (rows per rank) or train on more ranks")
            new = self._probe(missing, insert=True)
            found[found < 0] = new
        return found[inverse], new

    def _probe(self, uniq: torch.Tensor, *, insert: bool) -> torch.Tensor:
        rows = torch.full_like(uniq, -1)
        pending = torch.arange(len(uniq), device=uniq.device)
        slot = key_hash(uniq, _SALT) % self.capacity
        # A get-only probe of an absent key in a full table visits every slot once. An insert
        # always ends (the capacity was checked): each round some key wins a slot or advances.
        rounds = 0
        while len(pending) and (insert or rounds < self.capacity):
            rounds += 1
            s = slot[pending]
            used = self.used[s]
            hit = used & (self.slot_keys[s] == uniq[pending])
            rows[pending[hit]] = s[hit]
            done = hit.clone()
            if insert:
                won = self._claim(uniq[pending], s, ~used)
                rows[pending[won]] = s[won]
                done |= won
                advance = used & ~hit  # losers of a race retry the slot, now taken
            else:
                done |= ~used  # an empty slot ends the probe: absent
                advance = ~done
            slot[pending[advance]] = (s[advance] + 1) % self.capacity
            pending = pending[~done]
        return rows

    def _claim(self, keys: torch.Tensor, slot: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """Give each free slot to the first (smallest) of ``keys`` probing it; returns who won."""
        won = torch.zeros_like(free)
        if not bool(free.any()):
            return won
        cand = free.nonzero().squeeze(1)
        first = torch.full((self.capacity,), len(free), dtype=torch.int64, device=slot.device)
        first.scatter_reduce_(0, slot[cand], cand, reduce="amin")
        winners = first[slot[cand]] == cand
        won[cand[winners]] = True
        taken = slot[won]
        self.slot_keys[taken] = keys[won]
        self.used[taken] = True
        return won

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"slot_keys": self.slot_keys, "used": self.used}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.slot_keys.copy_(state["slot_keys"])
        self.used.copy_(state["used"])
