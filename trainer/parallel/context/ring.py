"""Ring attention: the K/V blocks travel around the cp group, one hop per step.

Rank r starts with its own keys and values; at each of the ``cp`` steps it posts the block it
holds to rank r+1 and a receive from rank r-1 (one ``batch_p2p``), computes its queries against
the block it holds while the exchange runs, then waits and moves on to the received block. So
at step s it holds rank (r - s)'s block, and after cp - 1 hops it has met every rank's keys.
Each block is [K; V] stacked, one message per hop.

Backward runs the ring again with the saved local K/V (recomputing the scores, never storing
them), and the gradient of each K/V block travels with it: rank r adds its part of dK/dV to
the sum it received for the block it holds and passes it on while computing the next step.
After the last step one more hop brings each sum back to the block's owner, complete::

    step s:  post kv -> r+1 | compute dQ, dK/dV of block (r-s) | wait dkv from r-1 | add |
             post dkv -> r+1 (overlaps step s+1) | wait kv

Per rank and layer: cp - 1 K/V blocks sent in forward, cp - 1 K/V blocks and cp dK/dV blocks
in backward (dK/dV in the accumulation dtype, at least fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from trainer.comm.protocol import Communicator, Handle, P2POp, wait_all
from trainer.parallel.context.blocks import Accumulator, backward_blocks, delta_rows
from trainer.parallel.context.documents import document_plan
from trainer.parallel.context.layout import SequenceLayout


def _hop(comm: Communicator, block: torch.Tensor) -> tuple[torch.Tensor, list[Handle]]:
    """Post ``block`` to the next rank and a receive of the previous rank's; returns the
    receive buffer and the handles to wait on."""
    incoming = torch.empty_like(block)
    size = comm.size
    return incoming, comm.batch_p2p([P2POp("send", block, (comm.rank + 1) % size),
                                     P2POp("recv", incoming, (comm.rank - 1) % size)])


class RingAttention(Function):
    """Causal attention of this rank's queries against the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator, layout: SequenceLayout, scale: float,
                docs: torch.Tensor | None) -> torch.Tensor:
        q5 = q.unflatten(1, (k.shape[1], -1))
        rank, cp = comm.rank, comm.size
        kv = torch.stack([k, v])
        acc = Accumulator(q5)
        for step in range(cp):
            incoming, handles = _hop(comm, kv) if step < cp - 1 else (kv, [])
            acc.add(q5, kv[0], kv[1], document_plan(layout, docs, rank, (rank - step) % cp),
                    scale)
            wait_all(handles)
            kv = incoming
        out = acc.out.to(q.dtype).flatten(1, 2)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.comm, ctx.layout, ctx.scale, ctx.docs = comm, layout, scale, docs
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, scale, docs = ctx.comm, ctx.layout, ctx.scale, ctx.docs
        rank, cp = comm.rank, comm.size
        groups = k.shape[1]
        q5, dout5 = q.unflatten(1, (groups, -1)), dout.unflatten(1, (groups, -1))
        out5 = out.unflatten(1, (groups, -1))
        delta = delta_rows(dout5, out5)
        dq = torch.zeros(q5.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv_in = torch.zeros((2, *k.shape), dtype=lse.dtype, device=k.device)  # block held
        dkv_handles: list[Handle] = []
        for step in range(cp):
            incoming, kv_handles = _hop(comm, kv) if step < cp - 1 else (kv, [])
            part = backward_blocks(q5, kv[0], kv[1], dout5, out5, lse, delta,
                                   document_plan(layout, docs, rank, (rank - step) % cp),
                                   scale, dq)
            wait_all(dkv_handles)  # the sum of the ranks that held this block before
            dkv_in, dkv_handles = _hop(comm, dkv_in + part) if cp > 1 else (dkv_in + part, [])
            wait_all(kv_handles)
            kv = incoming
        wait_all(dkv_handles)
        return (dq.to(q.dtype).flatten(1, 2), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype),
                None, None, None, None)
