"""ZeRO-3: the parameters sharded too, in units gathered only while they are used.

    python -m trainer.train --model small --dp 4 --zero 3 --run-dir runs/z3

A *unit* is a run of parameters gathered and reduced together, one flat buffer, one collective
(never one per tensor, DeepSpeed#1069): each transformer block, and the parameters outside
the blocks (the embedding, the final norm, the head), which form the *root*. The units are the
buckets of the ZeRO layout (`trainer.parallel.zero.layout.unit_layout`), so a unit's parameter
shard, its gradient shard (`trainer.parallel.zero.unit_grads.UnitGradients`) and the
optimizer's pieces (`Zero3Optimizer`) are the same elements, and checkpoints are ZeRO-1/2's.

Between steps a rank holds its 1/dp *shard* of every unit. A unit's whole flat buffer exists
(its storage resized up, then all-gathered from the shards) only while it is needed:

* forward: the root when one of its modules (embedding, final norm, head) is called; block i
  before its forward, and the next ``prefetch`` blocks posted then (a depth fixed by the run,
  the same on every rank, never decided from timings: DeepSpeed#8431); block i freed after its
  forward;
* backward: block i gathered again before its backward (a hook on its output's gradient),
  the ``prefetch`` blocks before it posted then; every unit freed as soon as its gradients are
  complete and its reduce-scatter is posted (the root at the end of backward); a root
  module's units are gathered again before its backward if they were released since its
  forward (a later microbatch's forward ran first, under a pipeline schedule);
* outside autograd (evaluation), everything gathered is freed after the forward;
* before the optimizer updates the shards, any unit still gathered is freed (`settle`), so
  no whole buffer outlives the values it was gathered from.

The model's parameters stay the same objects (views of their unit's buffer): freeing resizes
the buffer's storage to 0 bytes, gathering resizes it back, as FSDP1 does. Every collective is
posted from the main thread in the order the hooks fire, which is the same on every rank for
the same graph: blocks run in order, and autograd finishes a block's gradients (its
accumulate-grad nodes go first) before it computes the previous block's.

How it composes (each shown equal to the single-process model, tests/trainer/test_zero3.py):

* tensor and sequence parallelism: a rank's units are blocks of its TP slice, sharded over
  its DP group; TP's own collectives (and SP's sum of the norms' gradients over TP) run
  inside autograd, before the post-accumulate hooks hand a gradient to the unit's bucket;
* recomputation: the gather is the *hook on the block's output gradient*, not an explicit
  gather inside the recomputed function. That hook fires before autograd runs the block's
  backward node, which is where `trainer.parallel.tensor.random.checkpoint` re-runs the
  block's body (``Block.body``, not the module call, so the forward hooks do not fire a
  second time and nothing is freed in between); the unit is then freed by its
  reduce-scatter, after the recomputed forward's backward has used it;
* gradient accumulation: every microbatch gathers each unit again and reduce-scatters its
  gradients into the shards, which accumulate (ZeRO-2's choice, `grad_shards`): no
  unsharded gradient or parameter is kept across microbatches, at one reduce-scatter and
  two all-gathers per unit per microbatch;
* bf16: the units are held in bf16 (`cast`), the optimizer steps fp32 main pieces and
  rounds them into the bf16 shards after the step (`Zero3Optimizer.publish`), the rounding
  ZeRO-1's all-gather makes, so both run the same arithmetic;
* clipping and the NaN guard: the pieces carry their placements, so the gradient norm sums
  each element once over DP, TP (and the world); a skipped step leaves the shards as they
  were;
* pipeline parallelism, every schedule (gpipe, 1f1b, interleaved): the gather is *per
  microbatch*, never kept across the pipeline step: each forward and each backward of a
  microbatch gathers the stage's blocks and frees them after, so a stage holds at most the
  blocks computing and prefetched whatever the number of microbatches in flight (keeping
  them across the step would hold the whole stage, ZeRO-2's memory), at 2 all-gathers and 1
  reduce-scatter per unit per microbatch. Prefetch stays inside a run of consecutive layers
  (an interleaved stage's next chunk runs after other stages'). A unit is reduced as soon
  as one backward completes it (`unit_grads`), so a backward covering one chunk is fine;
  the tied embedding is a unit of its own on the first and last stage, summed over the
  embedding group like ZeRO-1's.

* mixture of experts: a MoE block's experts are a unit of their own, sharded over their
  expert-data-parallel group (`trainer.parallel.zero.split`: one `ParamUnits` per kind of
  parameter, each hooking the blocks it has units in).

Compiled blocks (their graphs would bypass the hooks) are refused before anything is built
(`trainer.parallel.zero.checks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.comm.protocol import Handle
from trainer.parallel.zero.layout import Piece, ShardLayout
from trainer.parallel.zero.optimizer import ZeroOptimizer
from trainer.parallel.zero.unit_grads import UnitGradients, unit_of
from trainer.placement.parameters import DP_AXES


@dataclass(repr=False)  # the whole buffers have no bytes to print
class UnitShards:
    """What `trainer.construction.shards.materialise_shards` built: the units' layout, their
    (freed) whole buffers and this rank's shards, and the most bytes construction held."""

    layout: ShardLayout
    full: list[torch.Tensor]
    shards: list[torch.Tensor]
    peak_bytes: int
    """The shards plus the largest parameter value in hand while the init streamed."""


class ParamUnits:
    """The parameter shards of every unit, and the hooks that gather and free them."""

    def __init__(self, model: nn.Module, sync: UnitGradients, prefetch: int,
                 built: UnitShards | None = None) -> None:
        """``built``: the units as `trainer.construction.shards` made them (the parameters
        already views of freed buffers, the shards filled), adopted as they are; without it
        the model's materialised parameters are copied into units and sharded here."""
        self.comm, self.layout, self.prefetch = sync.comm, sync.layout, prefetch
        self.params = sync.params
        names = [sync._names[id(p)] for p in sync.params]
        if built is not None and built.layout != self.layout:
            raise RuntimeError("the units built into shards do not match the gradient "
                               "layout")  # a wiring bug: the same parameters, two orders
        self.full: list[torch.Tensor] = [] if built is None else built.full
        self.shards: list[torch.Tensor] = [] if built is None else built.shards
        """This rank's block of each unit: the parameters' values between uses."""
        self.root: list[int] = []
        block_of: dict[str, int] = {}
        for k, b in enumerate(self.layout.buckets):
            if built is None:
                self._adopt(k, [sync.params[i] for i in b.params])
            unit = unit_of(names[b.params.start])
            if unit:
                block_of[unit] = k
            else:
                self.root.append(k)
        keys = list(getattr(model, "blocks", {}))
        # A run of consecutive layers (a pipeline chunk) has one value of layer - position.
        runs = [(int(key) if key.isdigit() else n) - n for n, key in enumerate(keys)]
        mine = [n for n, key in enumerate(keys) if f"blocks.{key}" in block_of]
        self.blocks = [keys[n] for n in mine]
        """The blocks with a unit here, in forward order (all of them, but for the experts'
        units of a mixture of experts, `trainer.parallel.zero.split`)."""
        self.order = [block_of[f"blocks.{keys[n]}"] for n in mine]
        """The blocks' units in forward order."""
        self.runs = [runs[n] for n in mine]
        """The run of consecutive layers each block is in: prefetch stays within one (a
        pipeline chunk; the next chunk of an interleaved stage runs after other stages')."""
        self.pending: dict[int, tuple[torch.Tensor, Handle | None]] = {}
        """Units whose all-gather is in flight (into their buffer), and its handle."""
        self.held = set(range(len(self.full))) if built is None else set()
        """Units whose whole buffer is allocated and gathered."""
        self.gathered_bytes = self.peak_gathered_bytes = 0
        """Bytes of whole units alive now (gathered or being gathered); their most since
        reset."""
        for k in sorted(self.held):
            self._count(self.full[k], +1)
            self._free(k)
        self.peak_gathered_bytes = 0
        self.model = model
        sync.release = self.release
        self._hook(model)

    @torch.no_grad()
    def _adopt(self, k: int, params: list[nn.Parameter]) -> None:
        """Unit ``k`` from materialised ``params``: copied into one buffer they then view,
        and this rank's block of it kept as the shard."""
        b = self.layout.buckets[k]
        full = params[0].new_zeros(b.end - b.start)
        for i, p in zip(b.params, params, strict=True):
            at = self.layout.offsets[i] - b.start
            full[at:at + p.numel()].copy_(p.view(-1))
            p.data = full[at:at + p.numel()].view_as(p)
        self.full.append(full)
        lo, hi = self.layout.shard(k)
        self.shards.append(full[lo - b.start:hi - b.start].clone())

    def cast(self, dtype: torch.dtype) -> None:
        """Hold every unit in ``dtype`` (bf16 under ``--precision bf16``, once the optimizer
        has taken its fp32 main pieces): the shards are rounded, the freed whole buffers
        reallocated in ``dtype`` and the parameters made views of them again; the model's
        floating buffers (the rotary tables) are cast too, as ``Module.to`` would."""
        for k, b in enumerate(self.layout.buckets):
            self._free(k)
            self.shards[k] = self.shards[k].to(dtype)
            full = torch.empty(b.end - b.start, dtype=dtype, device=self.shards[k].device)
            for i in b.params:
                p = self.params[i]
                at = self.layout.offsets[i] - b.start
                p.data = full[at:at + p.numel()].view(p.shape)
            full.untyped_storage().resize_(0)
            self.full[k] = full
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[name] = buf.to(dtype)

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
        unit_of_param = {id(self.params[i]): k for k, b in enumerate(self.layout.buckets)
                         for i in b.params}
        for part in parts:
            mine = sorted({unit_of_param[id(p)] for p in part.parameters()
                           if id(p) in unit_of_param})
            if not mine:  # none of its parameters are in these units (the experts' units)
                continue
            part.register_forward_pre_hook(self._before_model)
            part.register_forward_hook(lambda _m, _i, out, mine=mine: self._after_root(mine, out))
        last = getattr(model, "head", None) or (parts[-1] if parts else None)
        if last is not None and self.root:
            last.register_forward_hook(self._after_model)
        every = getattr(model, "blocks", {})
        blocks = [every[key] for key in self.blocks]
        for n, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, n=n: self._before(n, +1))
            block.register_forward_hook(lambda _m, _i, out, n=n: self._after(n, out))

    def _before(self, n: int, direction: int) -> None:
        """Block ``n`` gathered; the next ``prefetch`` blocks (in this pass's order) posted."""
        self._ensure(self.order[n])
        for m in range(n + direction, n + direction * (self.prefetch + 1), direction):
            if not (0 <= m < len(self.order) and self.runs[m] == self.runs[n]):
                break
            self._post(self.order[m])

    def _after(self, n: int, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad, n=n: self._before(n, -1))
        self._free(self.order[n])

    def _before_model(self, *_: Any) -> None:
        for k in self.root:
            self._ensure(k)

    def _after_root(self, units: list[int], out: Any) -> None:
        """Under a pipeline schedule a later microbatch's forward may run before an earlier
        one's backward releases the root: a root module's own ``units`` are gathered again,
        if they have to be, before its backward (the hook on its output's gradient); its
        backward then completes their gradients, which releases them again."""
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda _grad: self._ensure_all(units))

    def _ensure_all(self, units: list[int]) -> None:
        for k in units:
            self._ensure(k)

    def settle(self) -> None:
        """Free every unit still gathered (before the optimizer updates the shards, so that
        no whole buffer outlives the values it was gathered from)."""
        for k in range(len(self.full)):
            self._free(k)

    def _after_model(self, *_: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will need the root
            for k in self.root:
                self._free(k)


class Zero3Optimizer(ZeroOptimizer):
    """ZeRO-1's optimizer whose pieces are views of the parameter shards: a step updates the
    shards in place and the next gather reads them, so there is nothing to publish."""

    def __init__(self, sync: UnitGradients, full: torch.optim.Optimizer, units: ParamUnits,
                 dtype: torch.dtype | None = None,
                 blocked: Callable[[], AbstractContextManager[None]] = nullcontext, *,
                 over: tuple[str, ...] = DP_AXES) -> None:
        self.units = units
        super().__init__(sync, full, dtype, blocked, over=over)

    def _part(self, piece: Piece) -> torch.Tensor:
        return self.units.shards[piece.bucket][piece.at:piece.at + piece.hi - piece.lo]

    def _cast(self, dtype: torch.dtype) -> None:
        self.units.cast(dtype)

    def step(self, lr: float) -> None:
        self.units.settle()
        super().step(lr)

    @torch.no_grad()
    def publish(self) -> None:
        """fp32: nothing, the pieces are the shards the units gather from. bf16: the stepped
        fp32 main pieces rounded into the bf16 shards (the rounding ZeRO-1's all-gather makes),
        which the next gather reads."""
        if self.dtype is None:
            return
        for main, piece in zip(self.main, self.pieces, strict=True):
            self._part(piece).copy_(main.view(-1))
