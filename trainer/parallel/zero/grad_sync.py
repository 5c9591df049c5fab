"""ZeRO-1's gradient synchronisation: `DataParallel` with a reduce-scatter per bucket.

Everything `trainer.parallel.data.grad_sync` does stays: the contiguous buffer, buckets launched in
index order from the post-accumulate-grad hooks while backward runs, the MPI comm thread, no_sync()
for accumulation, the checks for missing gradients and differing models. What changes is the
buffer's layout (each bucket padded to a multiple of dp, `trainer.parallel.zero.layout`) and the
collective: each bucket is reduce-scattered *in place*, so after ``finish_grad_sync()`` only this
rank's shard of every bucket holds the DP-averaged gradient (the rest of the buffer still holds
this rank's own, unreduced contribution and is never read). The communication volume of the
reduce-scatter and the later all-gather together equals one all-reduce.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle, ReduceOp
from trainer.model.precision import main_grad_dtype
from trainer.parallel.data.buckets import Bucket
from trainer.parallel.data.grad_sync import DataParallel
from trainer.parallel.zero.layout import ShardLayout, shard_layout


class ShardedGradSync(DataParallel):
    """DP gradient sync that leaves each rank the averaged gradients of its shards only.

    ``alone``: parameters that get a bucket of their own (the tied embedding under PP, whose
    shard must cover the same elements on the first and the last stage)."""

    model: nn.Module  # what __init__ takes: the optimizer casts it (`ShardedSync`)

    def __init__(self, model: nn.Module, comm: Communicator, *, bucket_size: int = 1_000_000,
                 alone: Collection[nn.Parameter] = (), replicas: Communicator | None = None,
                 **kwargs: Any) -> None:
        """``replicas``: under hybrid sharding (``--zero-shard-size``), the same shard's
        holders in the other shard groups (``comm`` is this rank's group)."""
        self._bucket_size = bucket_size
        self._alone = {id(p) for p in alone}
        self.replicas = replicas
        self.layout: ShardLayout
        super().__init__(model, comm, bucket_size=bucket_size, grads_to_params=False, **kwargs)

    def _make_buffer(self) -> torch.Tensor:
        device = self.params[0].device if self.params else torch.device("cpu")
        dtype = main_grad_dtype({p.dtype for p in self.params})
        alone = [i for i, p in enumerate(self.params) if id(p) in self._alone]
        self.layout = shard_layout([p.numel() for p in self.params], self._bucket_size,
                                   self.comm.size, self.comm.rank, alone)
        buffer = torch.zeros(self.layout.size, dtype=dtype, device=device)
        for p, offset in zip(self.params, self.layout.offsets, strict=True):
            p.main_grad = buffer[offset:offset + p.numel()].view_as(p)  # type: ignore[attr-defined]  # DataParallel's own
        return buffer

    def _make_buckets(self, bucket_size: int, reduce_dtype: torch.dtype) -> list[Bucket]:
        wire = reduce_dtype != self.buffer.dtype and self.comm.size > 1
        return [Bucket(k, self.buffer[b.start:b.end], [self.params[i] for i in b.params],
                       wire=self.buffer.new_empty(b.end - b.start, dtype=reduce_dtype) if wire
                       else None)
                for k, b in enumerate(self.layout.buckets)]

    def shard_grad(self, k: int) -> torch.Tensor:
        """This rank's shard of bucket ``k`` in the buffer (averaged after the sync)."""
        lo, hi = self.layout.shard(k)
        return self.buffer[lo:hi]

    def _own(self, bucket: Bucket, t: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard(bucket.index)
        start = self.layout.buckets[bucket.index].start
        return t[lo - start:hi - start]

    def _post(self, bucket: Bucket, *, async_op: bool) -> Handle | None:
        src = self._wire(bucket)
        return self.comm.reduce_scatter(self._own(bucket, src), src, ReduceOp.SUM,
                                        async_op=async_op)

    def _unwire(self, bucket: Bucket) -> None:
        if bucket.wire is not None:
            self._own(bucket, bucket.view).copy_(self._own(bucket, bucket.wire))

    def finish_grad_sync(self) -> None:
        """Every bucket reduce-scattered over the shard group; under hybrid sharding this
        rank's shard of each is then averaged over the groups (the mean over all of dp)."""
        super().finish_grad_sync()
        if self.replicas is not None and self.replicas.size > 1:
            for k in range(len(self.buckets)):
                self.replicas.all_reduce(self.shard_grad(k), ReduceOp.AVG)
