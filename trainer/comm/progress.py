"""Progress records: what every communicator of this rank is doing, readable from outside.

`RecordingCommunicator` wraps any backend (like `trainer.comm.timing`): each operation on it,
and on every sub-communicator split from it, advances that communicator's sequence number and
writes the operation, dtype, size, peer and start time into this rank's `ProgressRecord`; its
completion (a blocking call's return, an async handle's ``wait()``/``is_completed()``) advances
the completed count. The trainer adds its step and compute time (`ProgressRecord.step`).

The record is a small memory-mapped file named by ``DTRAIN_PROGRESS_FILE`` (layout in
`workerenv`), on the host's local disk, so the agent reads it while the rank is stuck inside a
collective, stopped, or spinning in MPI: no thread, signal or lock of the rank is needed.

Every operation pays this on the rank's critical path, so the path is kept to the bone (under
1 µs per operation, `bench/progress.py`): two Python calls (`_Slot.enter`, `_Slot.after`), one
``pack_into`` of a `struct.Struct` bound once per slot and one store of its history word at
enter, and one store of the completed count into an aligned 8-byte word of the mapping at
completion (single stores, so a reader never sees half of one). Codes are module constants,
the dtype's code one dict lookup, the size the tensor's ``nbytes``, the time
``time.monotonic()`` (ages on one host, immune to clock steps).

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
from collections.abc import Mapping, Sequence

import torch

import workerenv
from trainer.comm.protocol import Communicator, Handle, P2POp, ReduceOp

(_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _BROADCAST, _SEND_OP, _RECV_OP, _BATCH_P2P,
 _ALL_TO_ALL, _BARRIER, _SPLIT) = (workerenv.PROGRESS_OPS.index(name) for name in (
     "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "batch_p2p",
     "all_to_all", "barrier", "split"))
_DTYPES = {getattr(torch, name): code for code, name in enumerate(workerenv.PROGRESS_DTYPES)
           if name}
_SEND, _RECV = 1, 2
_OP_AT, _DONE_AT = workerenv.PROGRESS_SLOT_ID.size, workerenv.PROGRESS_DONE_AT
_HISTORY_AT, _HISTORY = workerenv.PROGRESS_HISTORY_AT, workerenv.PROGRESS_HISTORY
# 1 for the codes of collectives (counted in each history word), 0 for point-to-point ones.
_COLLECTIVE = tuple(int(name not in workerenv.PROGRESS_P2P_OPS)
                    for name in workerenv.PROGRESS_OPS)
_clock = time.monotonic


class ProgressRecord:
    """This rank's record: a header and one slot per communicator (written by this rank only)."""

    def __init__(self, path: str, rank: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, workerenv.PROGRESS_SIZE)
            self._map = mmap.mmap(fd, workerenv.PROGRESS_SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")  # native order, as the layout is
        self._slots = 0
        self._avg = 0.0
        self._first = (0, 0.0)  # the first step reported, and when (a resume's start)
        self._header(rank=rank, step=0, at=0.0, compute=0.0)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], rank: int) -> ProgressRecord | None:
        """The record the launcher asked for, or None (not started by `dtrain launch`)."""
        path = environ.get(workerenv.PROGRESS_FILE)
        return cls(path, rank) if path else None

    def _header(self, *, rank: int, step: int, at: float, compute: float) -> None:
        self._rank = rank
        workerenv.PROGRESS_HEADER.pack_into(self._map, 0, workerenv.PROGRESS_MAGIC, os.getpid(),
                                            rank, step, at, compute, self._avg, *self._first)

    def step(self, step: int, compute_s: float) -> None:
        """The trainer finished ``step``, computing for ``compute_s`` seconds of it."""
        # A moving average over ~5 steps: stragglers are persistent, one slow step is not one.
        self._avg = compute_s if step <= 1 or self._avg == 0.0 else (
            0.8 * self._avg + 0.2 * compute_s)
        now = _clock()
        if not self._first[0]:
            self._first = (step, now)
        self._header(rank=self._rank, step=step, at=now, compute=compute_s)

    def slot(self, label: str, group_rank: int, group_size: int) -> _Slot:
        """A new communicator's slot; once every slot is taken, one in private memory (its
        operations run and are counted, but nobody sees them)."""
        if self._slots >= workerenv.PROGRESS_SLOTS:
            private = bytearray(workerenv.PROGRESS_SLOT_SIZE)
            return _Slot(private, 0, memoryview(private).cast("Q"))
        at = workerenv.PROGRESS_HEADER.size + self._slots * workerenv.PROGRESS_SLOT_SIZE
        self._slots += 1
        workerenv.PROGRESS_SLOT_ID.pack_into(self._map, at, label.encode()[:24], group_rank,
                                             group_size)
        return _Slot(self._map, at, self._words)


class _Slot:
    """A communicator's sequence number and completed count, written into its slot."""

    __slots__ = ("seq", "done", "collectives", "_buf", "_at", "_words", "_word", "_history",
                 "_pack")

    def __init__(self, buf: mmap.mmap | bytearray, at: int, words: memoryview) -> None:
        self.seq = self.done = self.collectives = 0
        self._buf, self._at, self._words = buf, at + _OP_AT, words
        self._word = (at + _DONE_AT) // 8   # an aligned word: one store, never torn
        self._history = (at + _HISTORY_AT) // 8
        self._pack = workerenv.PROGRESS_SLOT_OP.pack_into

    def enter(self, op: int, t: torch.Tensor | None, p2p: int = 0, peer: int = -1) -> None:
        seq = self.seq = self.seq + 1
        count = self.collectives = self.collectives + _COLLECTIVE[op]
        self._words[self._history + seq % _HISTORY] = op | ((peer + 1) & 0xFFFF) << 16 | \
            count << 32
        if t is None:
            self._pack(self._buf, self._at, seq, op, 0, p2p, peer, 0, _clock())
        else:
            self._pack(self._buf, self._at, seq, op, _DTYPES.get(t.dtype, 0), p2p, peer,
                       t.nbytes, _clock())

    def finish(self) -> None:
        done = self.done = self.done + 1
        self._words[self._word] = done

    def after(self, handle: Handle | None) -> Handle | None:
        """A blocking call returned (None: completed now), or an async one was posted."""
        if handle is None:  # finish() spelt out: one Python call less on every blocking op
            done = self.done = self.done + 1
            self._words[self._word] = done
            return None
        return RecordedHandle(handle, self, [1])


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
        self._slot = record.slot(label, inner.rank, inner.size)
        self._children: dict[str, int] = {}

    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)

    # Each operation spells its record out (no shared wrapper taking a lambda): a Python frame
    # and a closure per operation were most of the recording's cost.
    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Handle | None:
        slot = self._slot
        slot.enter(_ALL_REDUCE, t)
        return slot.after(self.inner.all_reduce(t, op, async_op=async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *,
                   async_op: bool = False) -> Handle | None:
        slot = self._slot
        slot.enter(_ALL_GATHER, inp)
        return slot.after(self.inner.all_gather(out, inp, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        slot = self._slot
        slot.enter(_REDUCE_SCATTER, inp)
        return slot.after(self.inner.reduce_scatter(out, inp, op, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        slot = self._slot
        slot.enter(_BROADCAST, t, 0, src)
        return slot.after(self.inner.broadcast(t, src, async_op=async_op))

    def send(self, t: torch.Tensor, dst: int) -> None:
        slot = self._slot
        slot.enter(_SEND_OP, t, _SEND, dst)
        self.inner.send(t, dst)
        slot.finish()

    def recv(self, t: torch.Tensor, src: int) -> None:
        slot = self._slot
        slot.enter(_RECV_OP, t, _RECV, src)
        self.inner.recv(t, src)
        slot.finish()

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        # Named by its first receive: the half of a batch that waits on someone else.
        first = next((o for o in ops if o.kind == "recv"), ops[0] if ops else None)
        kind = 0 if first is None else (_RECV if first.kind == "recv" else _SEND)
        self._slot.enter(_BATCH_P2P, first.tensor if first else None, kind,
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
        slot = self._slot
        slot.enter(_ALL_TO_ALL, inp)
        return slot.after(self.inner.all_to_all(out, inp, in_splits=in_splits,
                                                out_splits=out_splits, async_op=async_op))

    def barrier(self) -> None:
        slot = self._slot
        slot.enter(_BARRIER, None)
        self.inner.barrier()
        slot.finish()

    def split(self, color: int, key: int, *, name: str = "") -> Communicator:
        """The sub-group, recorded in a slot of its own (labelled as in the module docstring)."""
        self._slot.enter(_SPLIT, None)
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
