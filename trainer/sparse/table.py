"""`ShardedEmbedding`: one embedding table sharded by key over the ranks of a communicator.

Owner rank = key mod G. In identity mode the table has ``num_rows`` keys and the owner keeps key
k at local row k div G (the seed's step 4), so rank r holds ceil((num_rows - r) / G) rows. In
hash mode keys are any int64 and each rank maps the keys it owns to rows of a fixed ``capacity``
through `trainer.sparse.hashing.KeyIndex` (inserting in training, get-only in evaluation, where
an unseen key reads as a zero vector). Rows start at `trainer.sparse.keys.init_rows` of their
key, so every G starts from the same table.

A call looks up bags of keys like ``nn.EmbeddingBag`` (1-D keys with ``offsets``, or a 2-D
``(bags, hotness)`` tensor) and pools each bag with the ``sum`` or ``mean`` combiner. Forward is
the seed's: dispatch keys to owners, local lookup, rows back, original order restored
(`trainer.sparse.exchange`). Backward (an autograd function, so ``loss.backward()`` drives it,
on every rank) sends each key's gradient back to its owner along the reverse path; the owner
sums the gradients of duplicate keys (also across ranks and across calls of one step) into
`grad_rows`/`grad_values`, one row each, which `trainer.sparse.optim` applies. The gradient is
that of the sum of every rank's loss; ``grad_scale`` = 1/G turns it into the mean a data-parallel
trainer wants. The rows are a plain tensor, never an ``nn.Parameter``: nothing dense is reduced.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from trainer.comm.protocol import Communicator
from trainer.sparse.exchange import Exchange, dispatch, return_rows, to_owners
from trainer.sparse.hashing import KeyIndex, SparseError
from trainer.sparse.keys import init_rows

COMBINERS = ("sum", "mean")
#: The phases `timings` splits a lookup into: keys to owners, local rows, rows back, gradients.
PHASES = ("dispatch", "lookup", "return", "backward")
INIT_SCALE = 0.05  # initial rows uniform in [-INIT_SCALE, INIT_SCALE)
_INIT_CHUNK = 1 << 16  # rows initialised at a time


class ShardedEmbedding:
    """This rank's shard of a table of ``dim``-wide rows, and the lookups that use it."""

    def __init__(self, comm: Communicator, *, dim: int, num_rows: int = 0, capacity: int = 0,
                 seed: int = 0, init_scale: float = INIT_SCALE, grad_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 name: str = "embedding") -> None:
        self.comm, self.dim, self.seed, self.init_scale = comm, dim, seed, init_scale
        self.num_rows, self.grad_scale, self.name = num_rows, grad_scale, name
        self.training = True
        where = f"{name}, rank {comm.rank}"
        if (num_rows > 0) == (capacity > 0):
            raise SparseError("embedding table has no size", where,
                              f"num_rows={num_rows}, capacity={capacity}",
                              "Give num_rows (identity mode) or capacity (hash mode), not both")
        if num_rows:
            self.index = None
            local = max((num_rows - comm.rank + comm.size - 1) // comm.size, 0)
            self.weight = torch.empty((local, dim), dtype=dtype, device=device)
            for start in range(0, local, _INIT_CHUNK):  # bounded temporaries for huge shards
                rows = torch.arange(start, min(start + _INIT_CHUNK, local), device=device)
                self.weight[rows] = init_rows(comm.rank + comm.size * rows, dim, seed=seed,
                                              scale=init_scale, dtype=dtype)
        else:
            self.index = KeyIndex(capacity, where=where, device=device)
            self.weight = torch.zeros((capacity, dim), dtype=dtype, device=device)
        self.grad_rows: torch.Tensor | None = None
        self.grad_values: torch.Tensor | None = None
        self.last: Exchange | None = None
        self.timings = dict.fromkeys(PHASES, 0.0)
        """Seconds spent per phase since the last `take_timings` (host clock)."""
        self._anchor = torch.zeros((), dtype=dtype, device=device, requires_grad=True)

    @property
    def hashed(self) -> bool:
        return self.index is not None

    def train(self, mode: bool = True) -> ShardedEmbedding:
        self.training = mode
        return self

    def eval(self) -> ShardedEmbedding:
        return self.train(False)

    def __call__(self, keys: torch.Tensor, offsets: torch.Tensor | None = None, *,
                 combiner: str = "sum") -> torch.Tensor:
        """Pooled rows of each bag, shape ``(bags, dim)`` (an empty bag pools to zeros)."""
        if combiner not in COMBINERS:
            raise SparseError("unknown embedding combiner", self.name, repr(combiner),
                              f"Use one of {', '.join(COMBINERS)}")
        flat, bag, bags = _bags(keys, offsets)
        vectors = self.lookup(flat)
        pooled = vectors.new_zeros((bags, self.dim)).index_add(0, bag, vectors)
        if combiner == "mean":
            counts = torch.bincount(bag, minlength=bags).clamp(min=1).to(pooled.dtype)
            pooled = pooled / counts.unsqueeze(1)
        return pooled

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """The row of every key, in the keys' order, shape ``(len(keys), dim)``; collective."""
        self._check(keys)
        rows: torch.Tensor = _Lookup.apply(  # type: ignore[no-untyped-call]  # torch's
            self._anchor, self, keys)
        return rows

    def local_rows(self, owned: torch.Tensor) -> torch.Tensor:
        """Local rows of keys this rank owns (-1: absent in get-only hash mode)."""
        if self.index is None:
            return torch.div(owned, self.comm.size, rounding_mode="floor")
        rows, new = self.index.rows(owned, insert=self.training)
        if len(new):
            keys = self.index.slot_keys[new]
            self.weight[new] = init_rows(keys, self.dim, seed=self.seed, scale=self.init_scale,
                                         dtype=self.weight.dtype)
        return rows

    def accumulate(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Add gradients of local ``rows`` (duplicates summed) to this step's sparse gradient."""
        if self.grad_rows is not None:  # and so are its values
            rows = torch.cat([self.grad_rows, rows])
            grads = torch.cat([cast(torch.Tensor, self.grad_values), grads])
        uniq, inverse = torch.unique(rows, return_inverse=True)
        self.grad_rows = uniq
        self.grad_values = grads.new_zeros((len(uniq), self.dim)).index_add(0, inverse, grads)

    def take_timings(self) -> dict[str, float]:
        taken, self.timings = self.timings, dict.fromkeys(PHASES, 0.0)
        return taken

    def _tick(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[phase] += now - since
        return now

    def zero_grad(self) -> None:
        self.grad_rows = self.grad_values = None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"weight": self.weight}
        if self.index is not None:
            state["index"] = self.index.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["weight"])
        if self.index is not None:
            self.index.load_state_dict(state["index"])

    def _check(self, keys: torch.Tensor) -> None:
        if keys.dtype != torch.int64:
            raise SparseError("embedding keys have the wrong dtype", self.name,
                              f"got {keys.dtype}", "Pass int64 keys")
        if self.index is None and len(keys):
            low, high = int(keys.min()), int(keys.max())
            if low < 0 or high >= self.num_rows:
                bad = low if low < 0 else high
                raise SparseError("embedding key out of range",
                                  f"{self.name}, rank {self.comm.rank}",
                                  f"key {bad} outside 0..{self.num_rows - 1} of an identity-mode "
                                  "table", "Hash the keys into range, or use hash mode")


def _bags(keys: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                     int]:
    """Flat keys, the bag of each key, and the number of bags (nn.EmbeddingBag's input forms)."""
    if keys.dim() == 2:
        bags, hot = keys.shape
        bag = torch.arange(bags, device=keys.device).repeat_interleave(hot)
        return keys.reshape(-1), bag, bags
    if offsets is None:
        raise SparseError("embedding bags undefined", "lookup", "1-D keys need offsets",
                          "Pass offsets (the start of each bag) or a 2-D (bags, hotness) tensor")
    lengths = torch.diff(offsets, append=offsets.new_tensor([len(keys)]))
    bag = torch.arange(len(offsets), device=keys.device).repeat_interleave(lengths)
    return keys, bag, len(offsets)


class _Lookup(torch.autograd.Function):
    """Rows of keys; backward routes their gradients to the owners (the anchor gets none)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, table: ShardedEmbedding,
                keys: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        plan, owned = dispatch(table.comm, keys)
        start = table._tick("dispatch", start)
        rows = table.local_rows(owned)
        vectors = table.weight[rows.clamp(min=0)]
        vectors[rows < 0] = 0  # a key that get-only hash mode has never seen
        ctx.table, ctx.plan, ctx.rows = table, plan, rows
        table.last = plan
        start = table._tick("lookup", start)
        out = return_rows(table.comm, plan, vectors)
        table._tick("return", start)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        table: ShardedEmbedding = ctx.table
        start = time.perf_counter()
        owned = to_owners(table.comm, ctx.plan, grad * table.grad_scale
                          if table.grad_scale != 1.0 else grad)
        table.accumulate(ctx.rows, owned)
        table._tick("backward", start)
        return None, None, None
