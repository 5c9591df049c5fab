"""ZeRO-3's gradient shards: one bucket per unit, each reduce-scattered as soon as it is
complete.

A *unit* (`trainer.parallel.zero.units`) is a transformer block or a run of the parameters
outside the blocks (the *root*); a parameter named in ``alone`` (the tied embedding under
pipeline parallelism) is a unit of its own, so its shards hold the same elements on the first
and the last stage and can be summed over the embedding group.

ZeRO-2 (`trainer.parallel.zero.grad_shards`) launches its buckets in index order, in rounds
that need every backward to cover the whole model. Here a unit is launched the moment its
last gradient arrives, in the order the hooks fire: every collective of ZeRO-3 is posted from
the main thread in hook order (the all-gathers too), which is the same on every DP rank,
since they run the same graph (and, under pipeline parallelism, the same schedule). So a
backward may cover any part of the model, one chunk of the interleaved schedule included: a
unit reduces whenever one backward has produced all of its gradients, and again for the next
microbatch. A gradient that arrives twice before its unit is complete is an error, never a
silent mix; a unit that got no gradient in a step is reported by ``finish_grad_sync``.

Hybrid sharding (``--zero-shard-size N``, FSDP2's HSDP, ZeRO++'s hierarchical partitioning):
the units are sharded over N adjacent DP ranks (the mesh's ``zs`` axis) and replicated over
the ``zr`` axis; each unit is reduce-scattered inside the shard group during backward, and
``finish_grad_sync`` then all-reduces the shards across the groups, once per step (one
all-reduce of 1/N of the gradients, not one per unit and microbatch).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

from torch import Tensor, nn

from trainer.comm.protocol import Communicator
from trainer.parallel.data.grad_sync import GradSyncError
from trainer.parallel.zero.grad_shards import ShardedGradients, StagedBucket
from trainer.parallel.zero.layout import ShardLayout, unit_layout


def unit_of(name: str) -> str:
    """The unit a parameter belongs to: ``blocks.<i>`` for a block's, else the root."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def unit_runs(names: Sequence[str], alone: Collection[int] = ()) -> list[range]:
    """Consecutive runs of parameters (given in buffer order) of the same unit; an index in
    ``alone`` forms a run of its own."""
    runs, first = [], 0
    for i in range(1, len(names) + 1):
        if (i == len(names) or unit_of(names[i]) != unit_of(names[first]) or i in alone
                or i - 1 in alone):
            runs.append(range(first, i))
            first = i
    return runs


class UnitGradients(ShardedGradients):
    """ZeRO-2's gradient shards with one bucket per unit, each launched once complete; a
    unit's parameters are freed as soon as its reduce-scatter is posted
    (`trainer.parallel.zero.units.ParamUnits.release`)."""

    def __init__(self, model: nn.Module, comm: Communicator, *,
                 replicas: Communicator | None = None, built: bool = False,
                 **kwargs: Any) -> None:
        """``comm``: the ranks a unit is sharded over; ``replicas``: under hybrid sharding,
        the same shard's holders in the other shard groups, over which the reduced shards are
        then averaged. ``built``: the model was built straight into shards
        (`trainer.construction.shards`): its parameters hold no values to broadcast, and
        every rank drew the same serial initialisation from the same seed."""
        self._built = built
        self.release: Callable[[int], None] = lambda k: None
        """Called with a unit's index once its reduce-scatter is posted (`ParamUnits`)."""
        self.launches: list[int] = []
        """Reduce-scatters of each unit since the last `zero_grad`."""
        # Every collective from the main thread, in hook order (module docstring).
        super().__init__(model, comm, comm_thread=False, replicas=replicas, **kwargs)
        self.launches = [0] * len(self.buckets)

    def _make_layout(self) -> ShardLayout:
        names = [self._names[id(p)] for p in self.params]
        alone = [i for i, p in enumerate(self.params) if id(p) in self._alone]
        return unit_layout([p.numel() for p in self.params], unit_runs(names, alone),
                           self.comm.size, self.comm.rank)

    def _broadcast_from_rank0(self) -> None:
        if not self._built:
            super()._broadcast_from_rank0()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.launches = [0] * len(self.buckets)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise GradSyncError(
                "gradient arrived twice before its unit was reduced", self._names[id(p)],
                "under --zero 3 a unit is reduce-scattered once one backward has produced "
                "each of its parameters' gradients",
                "Use each parameter once per backward (or give it a unit of its own)")
        offset, n = self._where[id(p)]
        grad = cast(Tensor, p.grad)  # the hook runs once autograd has set it
        self._staging(bucket)[offset:offset + n].add_(grad.detach().reshape(-1))
        p.grad = None  # autograd's tensor is freed: the staging holds it now
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)
        self._retire(until=0)

    def _launch(self, bucket: StagedBucket) -> None:  # type: ignore[override]  # as ShardedGradients'
        self._reduce(bucket)
        bucket.ready.clear()
        self.launches[bucket.index] += 1
        if not self.overlap or self.comm.size == 1 or not self.in_flight:
            self._retire(until=len(self._in_flight))
        self.release(bucket.index)

    def finish_grad_sync(self) -> None:
        """Retire every reduce-scatter: the shards then hold the DP-averaged gradients. A unit
        left half-filled, or never reduced in the step, is an error unless ``allow_unused``
        (then it is reduced as it is, the same units on every rank)."""
        if not self._sync:
            raise GradSyncError("finish_grad_sync called inside no_sync()", "data parallel",
                                "the last microbatch must close the step's reductions",
                                "Run the last microbatch's backward outside no_sync()")
        short = [b for b in self.buckets if b.ready or not self.launches[b.index]]
        if short and not self.allow_unused:
            missing = [self._names[id(p)] for b in short for p in b.params
                       if id(p) not in b.ready]
            self._abandon()
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise GradSyncError("parameters got no gradient", shown,
                                f"{len(missing)} parameter(s) took no part in the loss, so "
                                "their units never completed",
                                "Use every parameter in the forward pass, or freeze the "
                                "unused ones (requires_grad=False)")
        self._hurry.set()
        for bucket in short:
            self._launch(bucket)
        self._retire(until=len(self._in_flight))
        self._hurry.clear()
        self._average_replicas()
