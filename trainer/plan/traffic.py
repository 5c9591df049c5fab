"""The bytes a rank sends, counted on its communicators as the planner prices them: a wrapper
around the world communicator (and every group split from it) that adds, per group, what each
operation puts on the rank's links under ring algorithms (the planner's `ASSUMPTIONS`), from
the tensors the trainer really passes:

    all_reduce      2 (p-1)/p x bytes          (reduce-scatter, then all-gather)
    reduce_scatter  (p-1)/p x input bytes
    all_gather      (p-1)/p x output bytes
    broadcast       (p-1)/p x bytes            (pipelined ring)
    all_to_all      the rows sent to the other members (``in_splits`` or equal blocks)
    send/batch_p2p  the bytes of each send; a receive sends nothing

So a measured count and `trainer.plan.estimate.comm` differ only where the planner's picture of
what the trainer sends is wrong. Groups are filed under the planner's kinds (`KIND`); scalars
over the world (loss, gradient norm) under "other".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp

KIND = {"dp": "dp", "edp": "dp", "dp_cp": "dp", "edp_cp": "dp", "zs": "dp", "zr": "dp",
        "tp": "tp", "pp": "pp", "embd": "pp", "ep": "ep", "cp": "cp"}
"""Group name (`trainer.comm.mesh`, the pipeline's embedding group) -> the planner's kind: the
gradients' groups (over dp and cp, ZeRO-3's shard and replica groups) are all "dp"."""


def _ring(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


class SentBytes:
    """Bytes sent, by kind, summed over every counted communicator of this rank."""

    def __init__(self) -> None:
        self.by_kind: dict[str, float] = defaultdict(float)

    def take(self) -> dict[str, float]:
        """The counts since the last call, and start over."""
        out, self.by_kind = dict(self.by_kind), defaultdict(float)
        return out


class CountedCommunicator:
    """Delegates every operation to ``inner`` and adds its bytes to ``sent`` (module
    docstring)."""

    def __init__(self, inner: Communicator, sent: SentBytes) -> None:
        self.inner, self.sent = inner, sent
        self.kind = KIND.get(inner.name, "other")

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)

    def _add(self, nbytes: float) -> None:
        self.sent.by_kind[self.kind] += nbytes

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        self._add(2 * _ring(self.size) * t.nbytes)
        return self.inner.all_reduce(t, op, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        self._add(_ring(self.size) * out.nbytes)
        return self.inner.all_gather(out, inp, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        self._add(_ring(self.size) * inp.nbytes)
        return self.inner.reduce_scatter(out, inp, op, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        self._add(_ring(self.size) * t.nbytes)
        return self.inner.broadcast(t, src, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None,
                   async_op: bool = False) -> Handle | None:
        if in_splits is None:
            self._add(_ring(self.size) * inp.nbytes)
        else:
            row = inp[0].nbytes if inp.shape[0] else 0
            self._add(row * (sum(in_splits) - in_splits[self.rank]))
        return self.inner.all_to_all(out, inp, in_splits=in_splits, out_splits=out_splits,
                                     async_op=async_op)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._add(t.nbytes)
        self.inner.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.inner.recv(t, src)

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        self._add(sum(op.tensor.nbytes for op in ops if op.kind == "send"))
        return self.inner.batch_p2p(ops)

    def barrier(self) -> None:
        self.inner.barrier()

    def split(self, color: int, key: int, *, name: str = "") -> Communicator:
        """The sub-group, counted into the same `SentBytes`."""
        return CountedCommunicator(self.inner.split(color, key, name=name), self.sent)
