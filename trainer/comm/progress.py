"""Progress records: what every communicator of this rank is doing, readable from outside.

`RecordingCommunicator` wraps any backend (like `trainer.comm.timing`): each operation on it,
and on every sub-communicator split from it, advances that communicator's sequence number and
writes the operation, dtype, size, peer and start time into this rank's `ProgressRecord`; its
completion (a blocking call's return, an async handle's ``wait()``/``is_completed()``) advances
the completed count. The trainer adds its step and compute time (`ProgressRecord.step`).

The record is a small memory-mapped file named by ``DTRAIN_PROGRESS_FILE`` (layout in
`workerenv`), on the host's local disk, so the agent reads it while the rank is stuck inside a
collective, stopped, or spinning in MPI: no thread, signal or lock of the rank is needed. Each
write is one ``struct.pack_into`` into the mapping (a few hundred ns; `bench/progress.py`).

On NCCL an operation counts as completed when the host has waited for it (its handle's
``wait()`` orders the stream and returns), so the record shows what the host last issued; a
device stuck in a kernel shows as the host blocked in its next synchronising call.

Groups are labelled ``<name>[<color>]`` (``dp[1]``: the DP group of color 1), the same on every
member because splits are collective; a second split of the same name and color on one parent
gets ``#2`` appended.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

import workerenv
from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp

_OPS = {name: code for code, name in enumerate(workerenv.PROGRESS_OPS)}
_DTYPES = {getattr(torch, name): code for code, name in enumerate(workerenv.PROGRESS_DTYPES)
           if name}
_SEND, _RECV = 1, 2


class ProgressRecord:
    """This rank's record: a header and one slot per communicator (written by this rank only)."""

    def __init__(self, path: str, rank: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, workerenv.PROGRESS_SIZE)
            self._map = mmap.mmap(fd, workerenv.PROGRESS_SIZE)
        finally:
            os.close(fd)
        self._slots = 0
        self._avg = 0.0
        self._header(rank=rank, step=0, at=0.0, compute=0.0)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], rank: int) -> ProgressRecord | None:
        """The record the launcher asked for, or None (not started by `dtrain launch`)."""
        path = environ.get(workerenv.PROGRESS_FILE)
        return cls(path, rank) if path else None

    def _header(self, *, rank: int, step: int, at: float, compute: float) -> None:
        self._rank = rank
        workerenv.PROGRESS_HEADER.pack_into(self._map, 0, workerenv.PROGRESS_MAGIC, os.getpid(),
                                            rank, step, at, compute, self._avg)

    def step(self, step: int, compute_s: float) -> None:
        """The trainer finished ``step``, computing for ``compute_s`` seconds of it."""
        # A moving average over ~5 steps: stragglers are persistent, one slow step is not one.
        self._avg = compute_s if step <= 1 or self._avg == 0.0 else (
            0.8 * self._avg + 0.2 * compute_s)
        self._header(rank=self._rank, step=step, at=time.time(), compute=compute_s)

    def slot(self, label: str, group_rank: int, group_size: int) -> int | None:
        """Offset of a new communicator's slot; None once every slot is taken (not recorded)."""
        if self._slots >= workerenv.PROGRESS_SLOTS:
            return None
        at = workerenv.PROGRESS_HEADER.size + self._slots * workerenv.PROGRESS_SLOT_SIZE
        self._slots += 1
        workerenv.PROGRESS_SLOT_ID.pack_into(self._map, at, label.encode()[:24], group_rank,
                                             group_size)
        return at

    def enter(self, at: int, seq: int, op: int, t: torch.Tensor | None, p2p: int = 0,
              peer: int = -1) -> None:
        dtype, nbytes = (0, 0) if t is None else (_DTYPES.get(t.dtype, 0), t.nbytes)
        workerenv.PROGRESS_SLOT_OP.pack_into(self._map, at + 32, seq, op, dtype, p2p, peer,
                                             nbytes, time.time())

    def done(self, at: int, count: int) -> None:
        workerenv.PROGRESS_SLOT_DONE.pack_into(self._map, at + 64, count)


class _Slot:
    """A communicator's sequence number and completed count, and where they are written."""

    def __init__(self, record: ProgressRecord, at: int | None) -> None:
        self.record, self.at, self.seq, self.done = record, at, 0, 0

    def enter(self, op: str, t: torch.Tensor | None, p2p: int = 0, peer: int = -1) -> None:
        self.seq += 1
        if self.at is not None:
            self.record.enter(self.at, self.seq, _OPS[op], t, p2p, peer)

    def finish(self) -> None:
        self.done += 1
        if self.at is not None:
            self.record.done(self.at, self.done)


class RecordedHandle:
    """An async operation's handle that counts the operation completed, once."""

    def __init__(self, inner: Handle, slot: _Slot, pending: list[int]) -> None:
        self.inner, self._slot, self._pending, self._done = inner, slot, pending, False

    def wait(self) -> None:
        self.inner.wait()
        self._finish()

    def is_completed(self) -> bool:
        if not self.inner.is_completed():
            return False
        self._finish()
        return True

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._pending[0] -= 1  # a batch_p2p is complete when all of its handles are
            if self._pending[0] == 0:
                self._slot.finish()


class RecordingCommunicator:
    """Delegates every operation to ``inner`` and records it (module docstring)."""

    def __init__(self, inner: Communicator, record: ProgressRecord, label: str) -> None:
        self.inner, self.record, self.label = inner, record, label
        self._slot = _Slot(record, record.slot(label, inner.rank, inner.size))
        self._children: dict[str, int] = {}

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)

    def _run(self, op: str, t: torch.Tensor | None, call: Callable[[], Handle | None],
             p2p: int = 0, peer: int = -1) -> Handle | None:
        self._slot.enter(op, t, p2p, peer)
        result = call()
        if result is None:
            self._slot.finish()
            return None
        return RecordedHandle(result, self._slot, [1])

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        return self._run("all_reduce", t, lambda: self.inner.all_reduce(t, op, async_op=async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        return self._run("all_gather", inp,
                         lambda: self.inner.all_gather(out, inp, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        return self._run("reduce_scatter", inp,
                         lambda: self.inner.reduce_scatter(out, inp, op, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        return self._run("broadcast", t, lambda: self.inner.broadcast(t, src, async_op=async_op),
                         peer=src)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._run("send", t, lambda: self.inner.send(t, dst), _SEND, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._run("recv", t, lambda: self.inner.recv(t, src), _RECV, src)

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        # Named by its first receive: the half of a batch that waits on someone else.
        first = next((o for o in ops if o.kind == "recv"), ops[0] if ops else None)
        kind = 0 if first is None else (_RECV if first.kind == "recv" else _SEND)
        self._slot.enter("batch_p2p", first.tensor if first else None, kind,
                         first.peer if first else -1)
        handles = self.inner.batch_p2p(ops)
        pending = [len(handles)]
        if not handles:
            self._slot.finish()
        return [RecordedHandle(h, self._slot, pending) for h in handles]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *,
                   in_splits: Sequence[int] | None = None,
                   out_splits: Sequence[int] | None = None,
                   async_op: bool = False) -> Handle | None:
        return self._run("all_to_all", inp, lambda: self.inner.all_to_all(
            out, inp, in_splits=in_splits, out_splits=out_splits, async_op=async_op))

    def barrier(self) -> None:
        self._run("barrier", None, self.inner.barrier)

    def split(self, color: int, key: int, *, name: str = "") -> Communicator:
        """The sub-group, recorded in a slot of its own (labelled as in the module docstring)."""
        self._slot.enter("split", None)
        sub = self.inner.split(color, key, name=name)
        self._slot.finish()
        label = f"{sub.name}[{color}]"
        self._children[label] = self._children.get(label, 0) + 1
        if self._children[label] > 1:
            label += f"#{self._children[label]}"
        return RecordingCommunicator(sub, self.record, label)


def recorded(comm: Communicator, environ: Mapping[str, str]) -> Communicator:
    """``comm`` (the world) recorded when the launcher asked for a progress record."""
    record = ProgressRecord.from_environ(environ, comm.rank)
    return comm if record is None else RecordingCommunicator(comm, record, "world")


def record_of(comm: Communicator) -> ProgressRecord | None:
    """The progress record behind ``comm``, if it is recorded."""
    return comm.record if isinstance(comm, RecordingCommunicator) else None
