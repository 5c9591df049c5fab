"""One gradient sync for a model whose parameters are replicated over different groups.

Most parameters are the same on every DP rank and are averaged over the whole DP group; some
are the same only on part of it, and say which axes their copies span (``param.dp_replicas``,
set by a module that places itself: the experts of `trainer.parallel.expert`). `data_parallel`
groups the
parameters by the axes their copies span and gives each group its own `DataParallel` over the
mesh's group of those axes, behind the one interface the training step uses
(`SplitDataParallel`); a model of one kind gets a plain `DataParallel`. The groups are built
widest first, in the same order on every rank: each construction is collective over its group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.parallel.data.buckets import BucketState
from trainer.parallel.data.grad_sync import DataParallel


class GradSync(Protocol):
    """What the training step uses of a gradient sync (`DataParallel`, `SplitDataParallel`,
    ZeRO-1's `trainer.parallel.zero.grad_sync.ShardedGradSync`)."""

    @property
    def comm(self) -> Communicator: ...
    @property
    def buffer(self) -> torch.Tensor: ...
    @property
    def buffers(self) -> list[torch.Tensor]: ...
    @property
    def params(self) -> list[nn.Parameter]: ...
    @property
    def buckets(self) -> Sequence[BucketState]: ...
    def no_sync(self) -> AbstractContextManager[None]: ...
    def zero_grad(self) -> None: ...
    def finish_grad_sync(self) -> None: ...


@dataclass(frozen=True)
class ParamSubset:
    """The part of a model one `DataParallel` synchronises (it reads only these three)."""

    named: Sequence[tuple[str, nn.Parameter]]
    buffer_list: Sequence[torch.Tensor] = ()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named)

    def buffers(self) -> Iterator[torch.Tensor]:
        return iter(self.buffer_list)


class SplitDataParallel:
    """Several `DataParallel`s, each over its own group, as one: the first (the widest group,
    which also broadcasts the model's buffers) answers for the communicator and the buffer."""

    def __init__(self, parts: Sequence[DataParallel]) -> None:
        self.parts = list(parts)

    @property
    def comm(self) -> Communicator:
        return self.parts[0].comm

    @property
    def buffer(self) -> torch.Tensor:
        return self.parts[0].buffer

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every part's gradient buffer (or ZeRO-2/3's shards): what the rank holds."""
        return [b for part in self.parts for b in part.buffers]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.params]

    @property
    def buckets(self) -> list[BucketState]:
        return [b for part in self.parts for b in part.buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def finish_grad_sync(self) -> None:
        for part in self.parts:
            part.finish_grad_sync()


def data_parallel(model: nn.Module, axes_of: Callable[[nn.Parameter], tuple[str, ...]],
                  group: Callable[..., Communicator], **options: Any) -> GradSync:
    """The gradient sync of ``model``: its parameters grouped by the axes their copies span
    (``axes_of``), each group synchronised over ``group(*axes)``; ``options`` go to every
    `DataParallel`."""
    parts = parts_by_axes(model, axes_of)
    if len(parts) == 1:
        [(axes, _)] = parts
        return DataParallel(model, group(*axes), **options)
    return SplitDataParallel([DataParallel(subset, group(*axes), **options)
                              for axes, subset in parts])


def parts_by_axes(model: nn.Module, axes_of: Callable[[nn.Parameter], tuple[str, ...]]
                  ) -> list[tuple[tuple[str, ...], ParamSubset]]:
    """``model``'s parameters grouped by the axes their copies span, widest group first (the
    same order on every rank, since each part's construction is collective over its group);
    the first part also carries the model's buffers, so they are broadcast once."""
    kinds: dict[tuple[str, ...], list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        kinds.setdefault(axes_of(p), []).append((name, p))
    order = sorted(kinds, key=lambda axes: (-len(axes), axes))
    return [(axes, ParamSubset(kinds[axes], list(model.buffers()) if i == 0 else []))
            for i, axes in enumerate(order)]
