"""A `Communicator` wrapper that counts calls, bytes and seconds per collective.

Wrap a group's communicator before handing it to the layers (``CountingCommunicator(groups.tp)``)
to see what tensor parallelism really sends: the bench compares the counts with the analytic
ones, and tests check the number of all-reduces per layer. ``phase`` is a free label set by
the caller ("forward", "backward", ...) under which each call is filed. Bytes are the payload
of the call's input (for all_gather the local block, for reduce_scatter the full input).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp

R = TypeVar("R")


@dataclass
class OpCount:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountingCommunicator:
    """Delegates every operation to ``inner`` and files (calls, bytes, seconds) under
    ``(phase, op)``. Seconds are host wall time of the call (async calls: the launch only)."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.phase = "other"
        self.counts: dict[tuple[str, str], OpCount] = defaultdict(OpCount)
        self.sizes: list[tuple[str, str, tuple[int, ...]]] = []
        """(phase, op, shape) of every call, in order."""

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)

    def reset(self) -> None:
        self.counts.clear()
        self.sizes.clear()

    def total(self, op: str | None = None, phase: str | None = None) -> OpCount:
        out = OpCount()
        for (ph, name), c in self.counts.items():
            if (op is None or name == op) and (phase is None or ph == phase):
                out.calls += c.calls
                out.bytes += c.bytes
                out.seconds += c.seconds
        return out

    def _timed(self, op: str, t: torch.Tensor, call: Callable[[], R]) -> R:
        start = time.perf_counter()
        result = call()
        entry = self.counts[(self.phase, op)]
        entry.calls += 1
        entry.bytes += _nbytes(t)
        entry.seconds += time.perf_counter() - start
        self.sizes.append((self.phase, op, tuple(t.shape)))
        return result

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        return self._timed("all_reduce", t,
                           lambda: self.inner.all_reduce(t, op, async_op=async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        return self._timed("all_gather", inp,
                           lambda: self.inner.all_gather(out, inp, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        return self._timed("reduce_scatter", inp,
                           lambda: self.inner.reduce_scatter(out, inp, op, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        return self._timed("broadcast", t, lambda: self.inner.broadcast(t, src, async_op=async_op))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None,
                   async_op: bool = False) -> Handle | None:
        return self._timed("all_to_all", inp, lambda: self.inner.all_to_all(
            out, inp, in_splits=in_splits, out_splits=out_splits, async_op=async_op))

    def send(self, t: torch.Tensor, dst: int) -> None:
        return self._timed("send", t, lambda: self.inner.send(t, dst))

    def recv(self, t: torch.Tensor, src: int) -> None:
        return self._timed("recv", t, lambda: self.inner.recv(t, src))

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        payload = torch.empty(sum(op.tensor.numel() for op in ops), dtype=torch.uint8)
        return self._timed("batch_p2p", payload, lambda: self.inner.batch_p2p(ops))

    def barrier(self) -> None:
        self.inner.barrier()

    def split(self, color: int, key: int, *, name: str = "") -> Communicator:
        return self.inner.split(color, key, name=name)
