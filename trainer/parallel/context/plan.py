"""Which attention blocks a cp rank computes, and what they cost (pure; no torch, no comm).

A block is one chunk of queries against one chunk of keys (`trainer.parallel.context.layout`).
Under the causal mask, decided by global positions, a block is

* ``FULL``: every key precedes every query (key chunk before query chunk): no mask;
* ``DIAGONAL``: the same chunk: the causal triangle, computed whole and masked;
* ``MASKED``: every key follows every query: skipped, never computed.

Both attention variants (ring and all-gather) compute exactly the blocks `block_plan` lists,
and `attention_flops` counts those same blocks, so the load-balance figures are the
implementation's own. With the zig-zag split every rank computes ``2*cp + 1`` blocks
(``2*cp - 1`` full, 2 diagonal); with a contiguous split rank r computes ``4r + 3``.
"""

from __future__ import annotations

import enum

from trainer.parallel.context.layout import SequenceLayout


class Visibility(enum.Enum):
    FULL = "full"
    DIAGONAL = "diagonal"
    MASKED = "masked"


def visibility(queries: range, keys: range) -> Visibility:
    """How the causal mask (key position <= query position) treats a block. The chunks of one
    layout are equal and disjoint or identical, so no other case arises."""
    if keys.stop <= queries.start:
        return Visibility.FULL
    if keys == queries:
        return Visibility.DIAGONAL
    if keys.start >= queries.stop:
        return Visibility.MASKED
    raise ValueError(f"chunks {queries} and {keys} overlap partially")  # not from user input


def block_plan(layout: SequenceLayout, q_rank: int, kv_rank: int
               ) -> list[tuple[int, int, Visibility]]:
    """The blocks ``q_rank`` computes against the keys ``kv_rank`` holds, as (local query
    chunk, local key chunk, visibility) with masked blocks left out; chunk 0 or 1 of each."""
    plan: list[tuple[int, int, Visibility]] = []
    for qi, queries in enumerate(layout.ranges(q_rank)):
        for ki, keys in enumerate(layout.ranges(kv_rank)):
            seen = visibility(queries, keys)
            if seen is not Visibility.MASKED:
                plan.append((qi, ki, seen))
    return plan


def block_flops(layout: SequenceLayout, *, batch: int, heads: int, head_dim: int) -> int:
    """Forward FLOPs of one block: QKᵀ and PV, 2·c²·K each per head (a diagonal block is
    computed whole, then masked; softmax and merge are lower order and left out)."""
    return 4 * batch * heads * layout.chunk_len ** 2 * head_dim


def attention_flops(layout: SequenceLayout, rank: int, *, batch: int, heads: int,
                    head_dim: int) -> int:
    """Forward FLOPs of ``rank``'s attention over the whole ring (backward is 2.5x: it
    recomputes the scores and forms dQ, dK, dV)."""
    blocks = sum(len(block_plan(layout, rank, kv_rank)) for kv_rank in range(layout.cp))
    return blocks * block_flops(layout, batch=batch, heads=heads, head_dim=head_dim)


def exchange_sends(cp: int, exchange: str, *, kv_bytes: int, grad_bytes: int
                   ) -> tuple[int, int]:
    """Bytes one rank sends per layer and microbatch to give every rank the sequence's K/V:
    (forward, backward). ``kv_bytes``: this rank's [K; V]; ``grad_bytes``: its [dK; dV] in
    the accumulation dtype. Forward, both exchanges send cp - 1 blocks (the ring's hops; the
    all-gather's ring share); backward sends them again, and the dK/dV sums: cp hops around
    the ring (the last brings each sum home), or the reduce-scatter's cp - 1 blocks
    (`trainer.parallel.context.ring`, `trainer.parallel.context.allgather`). Recomputation
    runs the forward exchange once more in backward."""
    if cp == 1:
        return 0, 0
    grads = (cp if exchange == "ring" else cp - 1) * grad_bytes
    return (cp - 1) * kv_bytes, (cp - 1) * kv_bytes + grads
