"""ZeRO-2's gradient synchronisation: each bucket is reduce-scattered into this rank's shard
during backward, and no rank keeps a whole gradient buffer.

    python -m trainer.train --model small --dp 4 --zero 2 --run-dir runs/zero2

The persistent gradient memory of a rank is its *shards*: for every bucket of the ZeRO layout
(`trainer.parallel.zero.layout`, the same buckets and the same owned elements as ZeRO-1, so the
sharded
optimizer and the checkpoints are shared) the 1/dp of it that this rank owns, one contiguous
buffer of ``layout.size / dp`` elements. A bucket's whole gradient exists only while it is
being filled and reduced:

* the first gradient of a bucket that backward produces allocates its *staging* tensor (the
  bucket's padded size, in the main-gradient dtype: fp32 under bf16); the post-accumulate-grad
  hook adds ``param.grad`` into it and drops ``param.grad`` at once (autograd's tensor is freed);
* when every parameter of the bucket is in, the staging is scaled by 1/dp (rounded to the
  reduce dtype when that is narrower, after which the fp32 staging is freed) and reduce-
  scattered asynchronously: MPI through the comm thread where the host has the cores, NCCL
  on its stream, as `trainer.parallel.data.grad_sync` does for the all-reduce;
* once the reduce-scatter is done, this rank's block is *added* into its shard and the bucket's
  tensors are freed. Finished reductions are retired at every hook, and at most `IN_FLIGHT`
  buckets reduce at once: a launch beyond that first waits for the oldest (a fixed number, the
  same on every rank, so waiting never changes which collectives are posted, only when).
  Without the cap a backward that outruns the network would stage every bucket, i.e. the
  whole gradient (measured: a tiny model at dp 2 did). ``finish_grad_sync`` retires the
  rest.

Buckets are launched in index order, in *rounds*: a round ends when every bucket has been
launched once, so every DP rank posts the same reduce-scatters in the same order whatever the
order its hooks fire in. That needs each backward to produce every parameter's gradient once
(true of every layout `trainer.parallel.zero.checks` admits: the interleaved pipeline schedule,
whose
backwards cover one model chunk each, is refused); a gradient that arrives twice in one round
is an error, never a silent mix.

Gradient accumulation: *every* microbatch's backward reduce-scatters into the shards (the
shards accumulate over microbatches, in the main-gradient dtype), so accumulation never holds
a whole gradient either; ``no_sync()`` does not defer anything here. It costs one
reduce-scatter per microbatch instead of one per step (DeepSpeed's ZeRO-2 makes the same
choice; FSDP2's ``set_requires_gradient_sync(False)`` makes the other, keeping unsharded
gradients until the last microbatch). With ``--grad-reduce-dtype bf16`` each microbatch's
contribution is rounded to bf16 once, instead of the step's sum once.

`staged_bytes` / `peak_staged_bytes` are the accounting of these transient tensors (staging
and reduce buffers alive), so a test and the benchmark can show the whole gradient is never
held: between steps the staged bytes are 0 and the gradient memory is the shards alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle, ReduceOp, wait_quietly
from trainer.model.precision import main_grad_dtype
from trainer.parallel.data.buckets import FutureHandle
from trainer.parallel.data.grad_sync import DataParallel, GradSyncError
from trainer.parallel.zero.layout import ShardLayout, shard_layout

IN_FLIGHT = 2
"""Buckets reducing at once: one being waited for while the next is already posted, as in
`trainer.parallel.zero.optimizer.ZeroOptimizer.publish` (DeepSpeed's overlap_comm double buffer)."""


def peak_staged_bytes(sizes: Sequence[int], *, in_flight: int, rounds: int, main_bytes: int,
                      wire_bytes: int) -> int:
    """The most bytes `ShardedGradients` stages in a step whose reductions finish only when it
    must wait for them (a network slower than backward: the worst case the `IN_FLIGHT` cap
    bounds), replayed from its own accounting for buckets of ``sizes`` elements (padded, in
    index order, as `trainer.parallel.zero.layout.shard_layout` cuts them): the staging of the
    bucket being filled (``main_bytes`` per element) besides the ``in_flight`` launched before
    it (their wires, ``wire_bytes`` per element; across a round's end when a step runs
    ``rounds`` backwards), plus, when the wire is narrower, a launch's staging and wire at once.
    ``in_flight`` 0: each reduction waited for at launch (overlap off, or one rank)."""
    staged = peak = 0
    flight: deque[int] = deque()
    for _ in range(rounds):
        for size in sizes:
            staged += size * main_bytes  # its first gradient allocates the staging
            peak = max(peak, staged)
            while flight and len(flight) >= max(in_flight, 1):  # `_reduce` waits the oldest
                staged -= flight.popleft()
            wire = size * wire_bytes
            if wire_bytes != main_bytes:  # the narrower copy is made, then the staging freed
                staged += wire
                peak = max(peak, staged)
                staged -= size * main_bytes
            flight.append(wire)
            if not in_flight:
                staged -= flight.popleft()
    return peak


@dataclass
class StagedBucket:
    """One bucket of the ZeRO layout under ZeRO-2: its shard, and its staging while filled."""

    index: int
    params: list[nn.Parameter]
    size: int
    """Elements of the padded bucket (a multiple of dp)."""
    shard: torch.Tensor
    """This rank's reduced block of the bucket (a view of the shards buffer)."""
    staging: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    launched: bool = False


@dataclass
class InFlight:
    """A launched reduce-scatter: ``wire`` is reduced, ``own`` (its block) goes to ``shard``."""

    wire: torch.Tensor
    own: torch.Tensor
    shard: torch.Tensor
    handle: Handle | None


class ShardedGradients(DataParallel):
    """DP gradient sync that keeps only this rank's reduced shards of the gradients.

    ``alone``: parameters that get a bucket of their own (the tied embedding under PP)."""

    # ZeRO-2's buckets hold a shard and a staging instead of a view of a whole buffer, and are
    # launched without ``async_op``: every `DataParallel` method that reads a `Bucket` (its hooks,
    # _launch_ready, _post, _wire, _unwire, _poll, _reset_buckets) is overridden or never reached
    # here, so the narrower bucket type and _launch are ignore[assignment]/ignore[override].
    buckets: list[StagedBucket]  # type: ignore[assignment]
    _bucket_of: dict[int, StagedBucket]  # type: ignore[assignment]
    model: nn.Module  # what __init__ takes: the optimizer casts it (`ShardedSync`)

    def __init__(self, model: nn.Module, comm: Communicator, *, bucket_size: int = 1_000_000,
                 alone: Collection[nn.Parameter] = (), replicas: Communicator | None = None,
                 **kwargs: Any) -> None:
        """``comm``: the ranks the gradients are sharded over; ``replicas``: under hybrid
        sharding (``--zero-shard-size``), the same shard's holders in the other shard groups,
        over which the reduced shards are then averaged, once per step."""
        self._bucket_size = bucket_size
        self._alone = {id(p) for p in alone}
        self.replicas = replicas
        self.layout: ShardLayout
        self._in_flight: deque[InFlight] = deque()
        self.staged_bytes = 0
        """Bytes of staging and reduce buffers alive now."""
        self.peak_staged_bytes = 0
        """Their most since the last `zero_grad`."""
        self.in_flight = IN_FLIGHT
        """Reduce-scatters in flight at most (0: each waited for at once). ZeRO-3 sets its
        prefetch depth, so a step holds the gradients of as many units as their parameters."""
        super().__init__(model, comm, bucket_size=bucket_size, grads_to_params=False, **kwargs)

    # -- set-up ------------------------------------------------------------------------------

    def _make_buffer(self) -> torch.Tensor:
        """The shards buffer: this rank's block of every bucket, bucket after bucket."""
        device = self.params[0].device if self.params else torch.device("cpu")
        self.layout = self._make_layout()
        return torch.zeros(self.layout.size // self.comm.size, device=device,
                           dtype=main_grad_dtype({p.dtype for p in self.params}))

    def _make_layout(self) -> ShardLayout:
        """Buckets of about ``bucket_size`` elements (ZeRO-3 cuts them at its units)."""
        alone = [i for i, p in enumerate(self.params) if id(p) in self._alone]
        return shard_layout([p.numel() for p in self.params], self._bucket_size,
                            self.comm.size, self.comm.rank, alone)

    def _make_buckets(self, bucket_size: int,  # type: ignore[override]
                      reduce_dtype: torch.dtype) -> list[StagedBucket]:
        self._reduce_dtype = reduce_dtype
        self._where: dict[int, tuple[int, int]] = {}
        """Where a parameter's gradient lies in its bucket's staging: (offset, numel)."""
        buckets, at = [], 0
        for k, b in enumerate(self.layout.buckets):
            width = (b.end - b.start) // self.comm.size
            params = [self.params[i] for i in b.params]
            buckets.append(StagedBucket(k, params, b.end - b.start, self.buffer[at:at + width]))
            for i, p in zip(b.params, params, strict=True):
                self._where[id(p)] = (self.layout.offsets[i] - b.start, p.numel())
            at += width
        return buckets

    def shard_grad(self, k: int) -> torch.Tensor:
        """This rank's shard of bucket ``k`` (averaged over DP after the sync)."""
        return self.buckets[k].shard

    # -- the training-step API ---------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero the shards; parameters hold no gradient (the hooks move it into staging)."""
        self._abandon()  # nothing, unless the previous step stopped half-way
        self.buffer.zero_()
        for p in self.params:
            p.grad = None
        self.launch_order = []
        self._rounds = 0  # rounds completed since: one per microbatch's backward
        self.peak_staged_bytes = self.staged_bytes

    def finish_grad_sync(self) -> None:
        """Retire every reduce-scatter: the shards then hold the DP-averaged gradients."""
        if not self._sync:
            raise GradSyncError("finish_grad_sync called inside no_sync()", "data parallel",
                                "the last microbatch must close the step's reductions",
                                "Run the last microbatch's backward outside no_sync()")
        open_round = self._next > 0 or any(b.ready for b in self.buckets)
        missing = [self._names[id(p)] for b in self.buckets[self._next:] for p in b.params
                   if id(p) not in b.ready] if open_round or not self._rounds else []
        if missing and not self.allow_unused:
            self._abandon()
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise GradSyncError("parameters got no gradient", shown,
                                f"{len(missing)} parameter(s) took no part in the loss, so "
                                "their buckets never completed",
                                "Use every parameter in the forward pass, or freeze the "
                                "unused ones (requires_grad=False)")
        self._hurry.set()
        if self._next:  # allow_unused: close the round, the same buckets on every rank
            while self._next:
                self._launch(self.buckets[self._next])
        self._retire(until=len(self._in_flight))
        self._hurry.clear()
        self._average_replicas()

    def _average_replicas(self) -> None:
        """Hybrid sharding: the reduce-scatters averaged over the shard group; averaging the
        shards over the groups makes it the mean over all of dp (HSDP's order)."""
        if self.replicas is not None and self.replicas.size > 1:
            self.replicas.all_reduce(self.buffer, ReduceOp.AVG)

    # -- hooks, launching, retiring ----------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        if bucket.launched or id(p) in bucket.ready:
            raise GradSyncError(
                "gradient arrived twice in one round of reductions", self._names[id(p)],
                "under --zero 2 every backward must produce each parameter's gradient once "
                "(buckets are reduced in the same order on every rank)",
                "Run each microbatch's backward over the whole model (the interleaved "
                "pipeline schedule is not supported with --zero 2)")
        offset, n = self._where[id(p)]
        grad = cast(torch.Tensor, p.grad)  # the hook runs once autograd has set it
        self._staging(bucket)[offset:offset + n].add_(grad.detach().reshape(-1))
        p.grad = None  # autograd's tensor is freed: the staging holds it now
        bucket.ready.add(id(p))
        while self._complete(self.buckets[self._next]):  # in index order, as far as ready
            self._launch(self.buckets[self._next])
        self._retire(until=0)

    @staticmethod
    def _complete(bucket: StagedBucket) -> bool:
        return not bucket.launched and len(bucket.ready) == len(bucket.params)

    def _staging(self, bucket: StagedBucket) -> torch.Tensor:
        if bucket.staging is None:
            bucket.staging = self.buffer.new_zeros(bucket.size)
            self._account(bucket.staging, +1)
        return bucket.staging

    def _launch(self, bucket: StagedBucket) -> None:  # type: ignore[override]
        """Start bucket ``bucket``'s reduce-scatter (the next in index order)."""
        self._reduce(bucket)
        self._next = (self._next + 1) % len(self.buckets)
        if self._next == 0:  # every bucket launched once: the next backward starts a round
            self._new_round()
            self._rounds += 1
        if not self.overlap or self.comm.size == 1 or not self.in_flight:
            self._retire(until=len(self._in_flight))

    def _reduce(self, bucket: StagedBucket) -> None:
        """Post ``bucket``'s reduce-scatter from its staging, which it then owns."""
        if len(self._in_flight) >= self.in_flight:  # bounded memory: wait for the oldest
            self._retire(until=len(self._in_flight) - self.in_flight + 1)
        staging = self._staging(bucket)
        bucket.staging, bucket.launched = None, True
        self.launch_order.append(bucket.index)
        staging.mul_(1.0 / self.comm.size)  # the SUM is then the mean (Megatron's 1/dp)
        wire = staging
        if self._reduce_dtype != staging.dtype and self.comm.size > 1:
            wire = staging.to(self._reduce_dtype)
            self._account(wire, +1)
            self._account(staging, -1)  # the fp32 staging is freed here
        width = bucket.size // self.comm.size
        own = wire[self.comm.rank * width:(self.comm.rank + 1) * width]
        self._in_flight.append(InFlight(wire, own, bucket.shard,
                                        self._post_scatter(own, wire)))

    def _post_scatter(self, own: torch.Tensor, wire: torch.Tensor) -> Handle | None:
        if self.comm.size == 1:
            return None
        if not self.overlap:
            return self.comm.reduce_scatter(own, wire, ReduceOp.SUM)
        if self._thread is not None:
            return FutureHandle(self._thread.submit(self._scatter_polled, own, wire))
        return self.comm.reduce_scatter(own, wire, ReduceOp.SUM, async_op=True)

    def _scatter_polled(self, own: torch.Tensor, wire: torch.Tensor) -> None:
        """The comm thread's reduce-scatter, polled with short sleeps (`DataParallel`)."""
        wait_quietly(self.comm.reduce_scatter(own, wire, ReduceOp.SUM, async_op=True),
                     self.poll_interval, hurry=self._hurry)

    def _retire(self, *, until: int) -> None:
        """Add finished reductions into the shards, oldest first: the first ``until`` waiting
        for them, then those already done."""
        while self._in_flight:
            head = self._in_flight[0]
            if until <= 0 and head.handle is not None and not head.handle.is_completed():
                return
            self._wait(head.handle)  # as DP's own buckets are waited for (`DataParallel._wait`)
            head.shard.add_(head.own.to(head.shard.dtype))
            self._account(head.wire, -1)
            self._in_flight.popleft()
            until -= 1

    def _abandon(self) -> None:
        """Leave no request in flight and no staging behind (before an error)."""
        self._retire(until=len(self._in_flight))
        for bucket in self.buckets:
            if bucket.staging is not None:
                self._account(bucket.staging, -1)
        self._new_round()

    def _new_round(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False
            bucket.staging = None
        self._next = 0

    def _account(self, t: torch.Tensor, sign: int) -> None:
        self.staged_bytes += sign * t.numel() * t.element_size()
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
