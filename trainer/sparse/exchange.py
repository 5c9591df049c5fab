"""The all-to-all exchanges of a lookup: keys to owners, rows back, gradients to owners.

This is the seed's data-parallel -> model-parallel -> data-parallel path on the Communicator's
variable-size ``all_to_all``. `dispatch` buckets the keys by owner (`trainer.sparse.keys.route`),
exchanges one count per peer (an equal-block all-to-all of G int64s) so every rank knows how
many keys it receives from each, then moves the keys. `Exchange` remembers both split lists:
`return_rows` sends each rank back as many rows as it sent keys, and `to_owners` moves
gradients along the same path in the lookup direction. Every exchange is one collective that
every member calls, in the same order, even with nothing to send (splits may be 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.comm.protocol import Communicator
from trainer.sparse.keys import Routing, restore, route


@dataclass(frozen=True)
class Exchange:
    """One lookup's plan: how this rank's keys were routed, and how many keys it received."""

    routing: Routing
    recv_splits: list[int]
    rank: int

    @property
    def received(self) -> int:
        return sum(self.recv_splits)

    def send_bytes(self, row_bytes: int) -> int:
        """Bytes this rank sends to other ranks for ``row_bytes`` per key (its own rows stay)."""
        return row_bytes * (self.routing.count - self.routing.splits[self.rank])


def dispatch(comm: Communicator, keys: torch.Tensor) -> tuple[Exchange, torch.Tensor]:
    """Send every key to its owner; returns the plan and the keys this rank owns, grouped by
    sending rank (rank 0's first)."""
    routing = route(keys, comm.size)
    counts = torch.tensor(routing.splits, dtype=torch.int64, device=keys.device)
    recv_counts = torch.empty_like(counts)
    comm.all_to_all(recv_counts, counts)
    plan = Exchange(routing, [int(n) for n in recv_counts.tolist()], comm.rank)
    owned = keys.new_empty(plan.received)
    comm.all_to_all(owned, keys[routing.order], in_splits=routing.splits,
                    out_splits=plan.recv_splits)
    return plan, owned


def return_rows(comm: Communicator, plan: Exchange, rows: torch.Tensor) -> torch.Tensor:
    """The owner's rows for the received keys, sent back and put in the original key order."""
    back = rows.new_empty((plan.routing.count, *rows.shape[1:]))
    comm.all_to_all(back, rows.contiguous(), in_splits=plan.recv_splits,
                    out_splits=plan.routing.splits)
    return restore(plan.routing.order, back)


def to_owners(comm: Communicator, plan: Exchange, grads: torch.Tensor) -> torch.Tensor:
    """Gradients of this rank's keys (original order) sent to the owners, arriving aligned with
    the keys `dispatch` delivered there."""
    owned = grads.new_empty((plan.received, *grads.shape[1:]))
    comm.all_to_all(owned, grads[plan.routing.order].contiguous(),
                    in_splits=plan.routing.splits, out_splits=plan.recv_splits)
    return owned
