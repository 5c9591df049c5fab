"""The ZeRO-1 optimizer: AdamW over this DP rank's shard only, then an all-gather.

    python -m trainer.train --model small --dp 2 --zero 1 --run-dir runs/zero

Each `Piece` of `trainer.parallel.zero.layout` (the part of one parameter inside this rank's shards)
gets a *main* parameter that AdamW steps: for an fp32 (or fp64) model a view of the model
parameter itself, so nothing is copied; under ``--precision bf16`` an fp32 copy of just that
part. AdamW's moments exist for the pieces only, so the optimizer state is 1/dp of the model's.
A piece's gradient is the matching part of this rank's reduce-scattered shard of the gradient
buffer (`trainer.parallel.zero.grad_sync`). AdamW is elementwise, so stepping pieces is stepping
whole
tensors; weight decay follows the piece's parameter (matrices only, `trainer.optim.optimizer`).

`ZeroOptimizer` has the `trainer.optim.main_weights.MainWeights` interface (``grads``,
``step``, ``sum_grad``, ``values``, ``publish``, ``optimizer``), so a training step is written
once for every way of holding the weights:

* every piece carries its placement: its parameter's, narrowed to the piece's range and no
  longer a replica over DP (`trainer.placement`), so the gradient norm counts each element
  once across DP, TP and PP, and a checkpoint holds each piece once;
* ``step`` runs AdamW on the pieces, then ``publish`` all-gathers the stepped shards, bucket
  by bucket, into every rank's parameters (the step waits for it: ``blocked`` marks the wait
  for the communication clock, `trainer.comm.timing`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import nn

from trainer.comm.protocol import Communicator, Handle, ReduceOp
from trainer.optim.optimizer import set_lr
from trainer.parallel.zero.layout import Piece, ShardLayout
from trainer.placement.parameters import DP_AXES


class ShardedSync(Protocol):
    """What the optimizer reads of a sharded gradient sync: ZeRO-1's
    `trainer.parallel.zero.grad_sync.ShardedGradSync` (a whole buffer, reduce-scattered in place) or
    ZeRO-2's `trainer.parallel.zero.grad_shards.ShardedGradients` (the shards alone)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def comm(self) -> Communicator: ...
    @property
    def params(self) -> list[nn.Parameter]: ...
    @property
    def layout(self) -> ShardLayout: ...
    def shard_grad(self, k: int) -> torch.Tensor: ...


class ZeroOptimizer:
    """The main pieces of this DP rank, the AdamW that steps them and the all-gather."""

    def __init__(self, sync: ShardedSync, full: torch.optim.Optimizer,
                 dtype: torch.dtype | None,
                 blocked: Callable[[], AbstractContextManager[None]] = nullcontext, *,
                 over: tuple[str, ...] = DP_AXES) -> None:
        """``full``: the AdamW the run built over the whole model, whose groups and
        hyperparameters the pieces take. ``dtype``: what the model is then cast to (bf16), or
        None (keep). ``over``: the mesh axes the pieces are sharded over (all of dp; under
        hybrid sharding the shard group's, the pieces staying replicas over the rest)."""
        self.sync, self.model, self.dtype, self.blocked = sync, sync.model, dtype, blocked
        self.layout, self.params = sync.layout, sync.params
        self.pieces = self.layout.pieces()
        group_of = {id(p): g for g, group in enumerate(full.param_groups)
                    for p in group["params"]}
        self.main: list[nn.Parameter] = []
        groups: list[list[nn.Parameter]] = [[] for _ in full.param_groups]
        for piece in self.pieces:
            part = self._part(piece)
            main = nn.Parameter(part.clone().float() if dtype is not None else part)
            main.placement = self.params[piece.param].placement.piece(  # type: ignore[attr-defined]
                piece.lo, piece.hi, over=over)
            self.main.append(main)
            groups[group_of[id(self.params[piece.param])]].append(main)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in full.param_groups]
        # every hyperparameter travels in the groups (decay per group, betas, eps, lr)
        self.optimizer = torch.optim.AdamW(
            [{**h, "params": ps} for h, ps in zip(hyper, groups, strict=True)],
            lr=full.defaults["lr"])
        self.full_groups = [list(g["params"]) for g in full.param_groups]
        if dtype is not None:
            for p in self.params:
                p.grad = None
            self._cast(dtype)

    def _cast(self, dtype: torch.dtype) -> None:
        """The model in ``dtype`` once the fp32 main pieces are taken (ZeRO-3 casts its
        units instead, `trainer.parallel.zero.units`)."""
        self.model.to(dtype)

    def _part(self, piece: Piece) -> torch.Tensor:
        """Where a piece's values live: its part of the model parameter (ZeRO-3: of the
        parameter shards, `trainer.parallel.zero.units`)."""
        return self.params[piece.param].detach().view(-1)[piece.lo:piece.hi]

    def grads(self) -> list[nn.Parameter]:
        """The main pieces, each with its part of the reduce-scattered gradient as .grad."""
        for main, piece in zip(self.main, self.pieces, strict=True):
            shard = self.sync.shard_grad(piece.bucket)
            main.grad = shard[piece.at:piece.at + piece.hi - piece.lo]
        return self.main

    def step(self, lr: float) -> None:
        """AdamW on this rank's pieces, then the all-gather of the parameters (`publish`),
        which the next forward needs."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        with self.blocked():
            self.publish()

    def values(self) -> list[nn.Parameter]:
        return self.main

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather the stepped shards into the parameters of every DP rank, bucket by
        bucket, the next bucket posted before this one is waited for (two buckets of
        transient memory at most)."""
        pending = None
        for k in range(len(self.layout.buckets)):
            posted = (k, *self.post_gather(k, self._own_values(k)))
            if pending is not None:
                self._unpack(*pending)
            pending = posted
        if pending is not None:
            self._unpack(*pending)

    def _unpack(self, k: int, flat: torch.Tensor, handle: Handle | None) -> None:
        if handle is not None:
            handle.wait()
        start = self.layout.buckets[k].start
        for i in self.layout.buckets[k].params:
            offset = self.layout.offsets[i] - start
            p = self.params[i]
            p.data.view(-1).copy_(flat[offset:offset + p.numel()])

    def _own_values(self, k: int) -> list[tuple[int, torch.Tensor]]:
        """(offset in the shard, values) of the main pieces in bucket ``k``."""
        return [(piece.at, main.detach().view(-1))
                for main, piece in zip(self.main, self.pieces, strict=True) if piece.bucket == k]

    def post_gather(self, k: int, values: list[tuple[int, torch.Tensor]], *,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Handle | None]:
        """Start the all-gather of bucket ``k`` whose own shard holds ``values``: (the flat
        bucket being filled, its handle or None)."""
        b = self.layout.buckets[k]
        p0 = self.params[b.params.start]
        flat = torch.zeros(b.end - b.start, dtype=dtype or p0.dtype, device=p0.device)
        lo, hi = self.layout.shard(k)
        own = flat[lo - b.start:hi - b.start]
        for at, v in values:
            own[at:at + v.numel()].copy_(v)
        if self.sync.comm.size == 1:
            return flat, None
        return flat, self.sync.comm.all_gather(flat, own, async_op=True)

    def sum_grad(self, param: nn.Parameter, group: Communicator) -> None:
        """Sum ``param``'s reduced shard over ``group`` (the tied embedding over the first and
        last pipeline stage: it has a bucket of its own on both, so the shards hold the same
        elements)."""
        index = next(i for i, p in enumerate(self.params) if p is param)
        bucket = next(k for k, b in enumerate(self.layout.buckets) if index in b.params)
        group.all_reduce(self.sync.shard_grad(bucket), ReduceOp.SUM)
