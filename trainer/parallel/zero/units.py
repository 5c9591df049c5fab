"""ZeRO-3 foundations: the parameters sharded too, in units gathered only while they are used.

    python -m trainer.train --model small --dp 4 --zero 3 --precision fp32 --run-dir runs/z3

A *unit* is a run of parameters gathered and reduced together, one flat buffer, one collective
(never one per tensor, DeepSpeed#1069): each transformer block, and the parameters outside
the blocks (the embedding, the final norm, the head), which form the *root*. The units are the
buckets of the ZeRO layout (`trainer.parallel.zero.layout.unit_layout`), so a unit's parameter
shard,
its gradient shard (`UnitGradients`, ZeRO-2's reduce-scatter cut at the units) and the
optimizer's pieces (`Zero3Optimizer`) are the same elements, and checkpoints are ZeRO-1/2's.

Between steps a rank holds its 1/dp *shard* of every unit. A unit's whole flat buffer exists
(its storage resized up, then all-gathered from the shards) only while it is needed:

* forward: the root when one of its modules (embedding, final norm, head) is called; block i
  before its forward, and the next ``prefetch`` blocks posted then (a depth fixed by the run,
  the same on every rank, never decided from timings: DeepSpeed#8431); block i freed after its
  forward;
* backward: block i gathered again before its backward (a hook on its output's gradient),
  the ``prefetch`` blocks before it posted then; every unit freed as soon as its gradients are
  complete and its reduce-scatter is posted (the root at the end of backward);
* outside autograd (evaluation), everything gathered is freed after the forward.

The model's parameters stay the same objects (views of their unit's buffer): freeing resizes
the buffer's storage to 0 bytes, gathering resizes it back, as FSDP1 does. Every collective is
posted from the main thread in the order the hooks fire, which is the same on every rank for
the same graph: blocks run in order, and autograd finishes a block's gradients (its
accumulate-grad nodes go first) before it computes the previous block's.

What this stage runs with is checked before anything is built (`trainer.parallel.zero.checks`): data
parallelism only, fp32 (or fp64), no recomputation; accumulation and clipping compose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle
from trainer.parallel.zero.grad_shards import ShardedGradients, StagedBucket
from trainer.parallel.zero.layout import Piece, ShardLayout, unit_layout
from trainer.parallel.zero.optimizer import ZeroOptimizer


def unit_of(name: str) -> str:
    """The unit a parameter belongs to: ``blocks.<i>`` for a block's, else the root."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def unit_runs(names: Sequence[str]) -> list[range]:
    """Consecutive runs of parameters (given in buffer order) of the same unit."""
    runs, first = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or unit_of(names[i]) != unit_of(names[first]):
            runs.append(range(first, i))
            first = i
    return runs


class UnitGradients(ShardedGradients):
    """ZeRO-2's gradient shards with one bucket per unit; a unit's parameters are freed as
    soon as its reduce-scatter is posted (`ParamUnits.release`)."""

    def __init__(self, model: nn.Module, comm: Communicator, **kwargs: Any) -> None:
        self.release: Callable[[int], None] = lambda k: None
        """Called with a unit's index once its reduce-scatter is posted (`ParamUnits`)."""
        # Every collective from the main thread, in hook order (module docstring).
        super().__init__(model, comm, comm_thread=False, **kwargs)

    def _make_layout(self) -> ShardLayout:
        names = [self._names[id(p)] for p in self.params]
        return unit_layout([p.numel() for p in self.params], unit_runs(names),
                           self.comm.size, self.comm.rank)

    def _launch(self, bucket: StagedBucket) -> None:
        super()._launch(bucket)
        self.release(bucket.index)


class ParamUnits:
    """The parameter shards of every unit, and the hooks that gather and free them."""

    def __init__(self, model: nn.Module, sync: UnitGradients, prefetch: int) -> None:
        self.comm, self.layout, self.prefetch = sync.comm, sync.layout, prefetch
        names = [sync._names[id(p)] for p in sync.params]
        self.full: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        """This rank's block of each unit: the parameters' values between uses."""
        self.root: list[int] = []
        block_of: dict[str, int] = {}
        for k, b in enumerate(self.layout.buckets):
            params = [sync.params[i] for i in b.params]
            full = params[0].new_zeros(b.end - b.start)
            with torch.no_grad():
                for i, p in zip(b.params, params, strict=True):
                    at = self.layout.offsets[i] - b.start
                    full[at:at + p.numel()].copy_(p.view(-1))
                    p.data = full[at:at + p.numel()].view_as(p)
            self.full.append(full)
            lo, hi = self.layout.shard(k)
            self.shards.append(full[lo - b.start:hi - b.start].clone())
            unit = unit_of(names[b.params.start])
            if unit:
                block_of[unit] = k
            else:
                self.root.append(k)
        self.order = [block_of[f"blocks.{key}"] for key in getattr(model, "blocks", {})]
        """The blocks' units in forward order."""
        self.pending: dict[int, tuple[torch.Tensor, Handle | None]] = {}
        """Units whose all-gather is in flight (into their buffer), and its handle."""
        self.held = set(range(len(self.full)))
        """Units whose whole buffer is allocated and gathered."""
        self.gathered_bytes = self.peak_gathered_bytes = 0
        """Bytes of whole units alive now (gathered or being gathered); their most since
        reset."""
        for k in range(len(self.full)):
            self._count(self.full[k], +1)
            self._free(k)
        self.peak_gathered_bytes = 0
        sync.release = self.release
        self._hook(model)

    # -- gather and free -------------------------------------------------------------------

    def _post(self, k: int) -> None:
        """Start gathering unit ``k`` into its buffer unless it is gathered or on its way
        (MPI writes the buffer in place: `trainer.comm.mpi.buffers.numpy_view`)."""
        if k in self.held or k in self.pending:
            return
        full = self.full[k]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self._count(full, +1)
        if self.comm.size == 1:
            with torch.no_grad():
                full.copy_(self.shards[k])
            self.held.add(k)
            return
        self.pending[k] = (full, self.comm.all_gather(full, self.shards[k], async_op=True))

    def _ensure(self, k: int) -> None:
        """Unit ``k`` gathered (waiting for it if it was prefetched)."""
        self._post(k)
        if k in self.pending:
            _, handle = self.pending.pop(k)
            if handle is not None:
                handle.wait()
            self.held.add(k)

    def _count(self, t: torch.Tensor, sign: int) -> None:
        self.gathered_bytes += sign * t.numel() * t.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, k: int) -> None:
        if k in self.pending:  # prefetched, never used: it must land before it goes
            self._ensure(k)
        if k in self.held:
            self.full[k].untyped_storage().resize_(0)
            self._count(self.full[k], -1)
            self.held.discard(k)

    def release(self, k: int) -> None:
        """Unit ``k``'s gradients are complete and reducing: its parameters are not needed."""
        self._free(k)

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit gathered (reading or writing the whole model), freed after."""
        for k in range(len(self.full)):
            self._ensure(k)
        try:
            yield
        finally:
            for k in range(len(self.full)):
                self._free(k)

    # -- hooks -----------------------------------------------------------------------------

    def _hook(self, model: nn.Module) -> None:
        # The root's own modules, not the model's forward: the loss runs the embedding, the
        # blocks and the head without calling the model itself (`GPT.loss`, `GPT.head_loss`).
        parts = [m for name, m in model.named_children() if name != "blocks"]
        for part in parts:
            part.register_forward_pre_hook(self._before_model)
        last = getattr(model, "head", None) or (parts[-1] if parts else None)
        if last is not None:
            last.register_forward_hook(self._after_model)
        blocks = list(getattr(model, "blocks", {}).values())
        for n, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, n=n: self._before(n, +1))
            block.register_forward_hook(lambda _m, _i, out, n=n: self._after(n, out))

    def _before(self, n: int, direction: int) -> None:
        """Block ``n`` gathered; the next ``prefetch`` blocks (in this pass's order) posted."""
        self._ensure(self.order[n])
        for m in range(n + direction, n + direction * (self.prefetch + 1), direction):
            if 0 <= m < len(self.order):
                self._post(self.order[m])

    def _after(self, n: int, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad, n=n: self._before(n, -1))
        self._free(self.order[n])

    def _before_model(self, *_: Any) -> None:
        for k in self.root:
            self._ensure(k)

    def _after_model(self, *_: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will need the root
            for k in self.root:
                self._free(k)


class Zero3Optimizer(ZeroOptimizer):
    """ZeRO-1's optimizer whose pieces are views of the parameter shards: a step updates the
    shards in place and the next gather reads them, so there is nothing to publish."""

    def __init__(self, sync: UnitGradients, full: torch.optim.Optimizer, units: ParamUnits,
                 blocked: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.units = units
        super().__init__(sync, full, None, blocked)

    def _part(self, piece: Piece) -> torch.Tensor:
        return self.units.shards[piece.bucket][piece.at:piece.at + piece.hi - piece.lo]

    def publish(self) -> None:
        """Nothing: the pieces are the shards the units gather from."""
