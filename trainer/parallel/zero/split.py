"""ZeRO-3 for a model whose parameters are replicated over different data-parallel groups: the
experts of a mixture of experts (`trainer.parallel.expert`) are the same only on their
expert-data-parallel group (edp: the DP ranks at the same place of every EP block), the dense
parameters on all of dp.

    python -m trainer.train --model tiny --moe-experts 4 --dp 4 --ep 2 --zero 3 --run-dir runs/m

Each kind of parameter is a ZeRO-3 of its own, as `trainer.parallel.data.split` gives each its
own `DataParallel`: `UnitGradients` and `ParamUnits` over that part of the model, sharded and
reduce-scattered over the mesh's group of the axes its copies span. So a MoE block is two
units, its dense parameters sharded over dp and its experts over edp, both gathered by the
block's hooks before its forward and backward (the dense part's hooks first, on every rank)
and freed after; a dense block has no experts' unit. The experts' gradients keep their 1/ep
hook (`trainer.parallel.expert.parallel`) and are averaged over edp by their reduce-scatter:
1/dp in all, as without ZeRO. The parts are built widest group first, the same order on every
rank (each construction is collective over its group).

One AdamW steps the pieces of every part (`Zero3Optimizer` reading `SplitUnitGradients` and
`SplitUnits`, which number the parts' parameters and units one after the other), so the
optimizer state, the gradient norm and the checkpoints see one set of pieces, each carrying
its placement: an expert's piece is sharded over edp, a dense piece over dp.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.parallel.data.split import SplitDataParallel, parts_by_axes
from trainer.parallel.zero.layout import Piece, ShardedBucket, ShardLayout
from trainer.parallel.zero.unit_grads import UnitGradients
from trainer.parallel.zero.units import ParamUnits, Zero3Optimizer
from trainer.placement.parameters import DP_AXES


class SplitLayout:
    """The parts' layouts as one: parameters and buckets (units) numbered part after part.
    A bucket's ``start`` and ``end`` stay offsets in its own part's buffer."""

    def __init__(self, parts: Sequence[ShardLayout]) -> None:
        self.parts = list(parts)
        self.first_param = _starts(len(p.numels) for p in self.parts)
        self.first_bucket = _starts(len(p.buckets) for p in self.parts)
        self.buckets: tuple[ShardedBucket, ...] = tuple(
            replace(b, params=range(b.params.start + at, b.params.stop + at))
            for part, at in zip(self.parts, self.first_param, strict=True)
            for b in part.buckets)

    def pieces(self) -> list[Piece]:
        return [replace(piece, param=piece.param + p0, bucket=piece.bucket + b0)
                for part, p0, b0 in zip(self.parts, self.first_param, self.first_bucket,
                                        strict=True)
                for piece in part.pieces()]

    def locate(self, k: int) -> tuple[int, int]:
        """(part, its own index) of bucket ``k``."""
        part = max(i for i, b0 in enumerate(self.first_bucket) if b0 <= k)
        return part, k - self.first_bucket[part]


def _starts(sizes: Iterator[int] | Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


class SplitUnitGradients(SplitDataParallel):
    """The parts' `UnitGradients` as the one gradient sync the step and the optimizer use."""

    def __init__(self, model: nn.Module, parts: Sequence[UnitGradients]) -> None:
        super().__init__(parts)
        self.model, self.units = model, list(parts)
        self.layout = SplitLayout([part.layout for part in self.units])

    def shard_grad(self, k: int) -> torch.Tensor:
        part, own = self.layout.locate(k)
        return self.units[part].shard_grad(own)

    @property
    def staged_bytes(self) -> int:
        return sum(part.staged_bytes for part in self.units)

    @property
    def peak_staged_bytes(self) -> int:
        """The sum of the parts' peaks: a bound on the peak of their sum."""
        return sum(part.peak_staged_bytes for part in self.units)


class SplitUnits:
    """The parts' `ParamUnits` as one: their units numbered part after part."""

    def __init__(self, parts: Sequence[ParamUnits]) -> None:
        self.parts = list(parts)
        self.comm = self.parts[0].comm

    @property
    def shards(self) -> list[torch.Tensor]:
        return [s for part in self.parts for s in part.shards]

    @property
    def full(self) -> list[torch.Tensor]:
        return [f for part in self.parts for f in part.full]

    @property
    def held(self) -> set[int]:
        return {k for part in self.parts for k in part.held}

    @property
    def pending(self) -> set[int]:
        return {k for part in self.parts for k in part.pending}

    @property
    def gathered_bytes(self) -> int:
        return sum(part.gathered_bytes for part in self.parts)

    @property
    def peak_gathered_bytes(self) -> int:
        """The sum of the parts' peaks: a bound on the peak of their sum."""
        return sum(part.peak_gathered_bytes for part in self.parts)

    @peak_gathered_bytes.setter
    def peak_gathered_bytes(self, _value: int) -> None:
        for part in self.parts:  # restart every part's peak from what it holds now
            part.peak_gathered_bytes = part.gathered_bytes

    def cast(self, dtype: torch.dtype) -> None:
        for part in self.parts:
            part.cast(dtype)

    def settle(self) -> None:
        for part in self.parts:
            part.settle()

    @contextmanager
    def whole(self) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.whole())
            yield


def build_split_zero3(model: nn.Module, optimizer: torch.optim.Optimizer,
                      axes_of: Callable[[nn.Parameter], tuple[str, ...]],
                      group: Callable[..., Communicator], dtype: torch.dtype | None, *,
                      prefetch: int,
                      blocked: Callable[[], AbstractContextManager[None]] = nullcontext,
                      alone: Sequence[nn.Parameter] = (), **options: Any
                      ) -> tuple[SplitUnitGradients, Zero3Optimizer]:
    """ZeRO-3 of ``model`` whose parameters span different DP axes (``axes_of``), each kind
    sharded over ``group(*axes)``, widest first; ``options`` go to every `UnitGradients`
    (bucket size, overlap, reduce dtype)."""
    grads, units = [], []
    for axes, subset in parts_by_axes(model, axes_of):
        mine = {id(p) for p in subset.parameters()}
        part = UnitGradients(subset,  # type: ignore[arg-type]  # reads what a module has
                             group(*axes), alone=[p for p in alone if id(p) in mine], **options)
        part.in_flight = prefetch
        grads.append(part)
        units.append(ParamUnits(model, part, prefetch))
    sync = SplitUnitGradients(model, grads)
    # The split sync and units have the reads `Zero3Optimizer` makes of one part's.
    return sync, Zero3Optimizer(sync, optimizer, SplitUnits(units),  # type: ignore[arg-type]
                                dtype, blocked, over=DP_AXES)
