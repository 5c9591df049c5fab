"""All-gather attention: every rank gathers the whole sequence's K/V once per layer.

Llama 3's context parallelism (arXiv 2407.21783 §3.3.2): one all-gather of the [K; V] blocks of
the cp group, then this rank's queries against every block the causal plan keeps
(`trainer.parallel.context.plan`), merged as in the ring. K/V are much smaller than Q under
grouped-query attention, and one collective replaces cp - 1 dependent hops, at the price of
holding every rank's K/V at once during the layer's attention.

Only the local K/V are saved for backward; backward gathers them again (as the ring sends them
again), computes every block's dK/dV here and reduce-scatters them to their owners (in the
accumulation dtype, at least fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from trainer.comm.protocol import Communicator
from trainer.parallel.context.blocks import Accumulator, backward_blocks, delta_rows
from trainer.parallel.context.documents import document_plan
from trainer.parallel.context.layout import SequenceLayout


def _gather_kv(comm: Communicator, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every rank's [K; V] (cp, 2, B, G, T_local, K), rank order."""
    kv = torch.stack([k, v])
    everyone = kv.new_empty((comm.size * 2, *k.shape))
    comm.all_gather(everyone, kv)
    out: torch.Tensor = everyone.unflatten(0, (comm.size, 2))  # torch leaves it unannotated
    return out


class AllGatherAttention(Function):
    """Causal attention of this rank's queries against the gathered keys and values."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator, layout: SequenceLayout, scale: float,
                docs: torch.Tensor | None) -> torch.Tensor:
        q5 = q.unflatten(1, (k.shape[1], -1))
        acc = Accumulator(q5)
        for owner, kv in enumerate(_gather_kv(comm, k, v)):
            acc.add(q5, kv[0], kv[1], document_plan(layout, docs, comm.rank, owner), scale)
        out = acc.out.to(q.dtype).flatten(1, 2)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.comm, ctx.layout, ctx.scale, ctx.docs = comm, layout, scale, docs
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, scale, docs = ctx.comm, ctx.layout, ctx.scale, ctx.docs
        groups = k.shape[1]
        q5, dout5 = q.unflatten(1, (groups, -1)), dout.unflatten(1, (groups, -1))
        out5 = out.unflatten(1, (groups, -1))
        delta = delta_rows(dout5, out5)
        dq = torch.zeros(q5.shape, dtype=lse.dtype, device=q.device)
        dkv_all = torch.stack([
            backward_blocks(q5, kv[0], kv[1], dout5, out5, lse, delta,
                            document_plan(layout, docs, comm.rank, owner), scale, dq)
            for owner, kv in enumerate(_gather_kv(comm, k, v))])
        dkv = dkv_all.new_empty((2, *k.shape))
        comm.reduce_scatter(dkv, dkv_all.flatten(0, 1))
        return (dq.to(q.dtype).flatten(1, 2), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)
