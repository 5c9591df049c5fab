"""`Communicator` over mpi4py for torch CPU tensors: the backend of CPU runs and of every test.

Zero copy. A CPU tensor is handed to MPI as a numpy array sharing the tensor's memory
(`buffers.numpy_view`; unlike ``tensor.numpy()`` it leaves the storage resizable, which ZeRO-3
needs), which mpi4py takes through the buffer protocol, so MPI reads and writes the tensor's
own storage. Tensors are detached first (reduce a parameter's ``.grad`` or the parameter
itself; autograd is not involved).

Copies happen only where MPI cannot work on the tensor directly, and the result is copied back:

* a non-contiguous tensor (a strided slice) is staged in a contiguous copy;
* fp16 and bf16 have no MPI reduction (MPICH's DLPack import sees bf16 as bytes, and fp16
  support varies between MPI libraries), so reductions run in an fp32 copy that is rounded back
  once at the end; moving them (gather, broadcast, p2p) needs no arithmetic, so they travel as
  int16 views, bit for bit and zero copy;
* an all_gather whose input is this rank's block of the output runs MPI_IN_PLACE; other overlaps
  between input and output are staged.

Asynchronous operations use MPI's nonblocking calls (``Iallreduce``, ``Iallgather``,
``Ireduce_scatter_block``, ``Ibcast``, ``Ialltoallv``, ``Isend``/``Irecv``). The handle keeps the
request and every staging buffer alive until ``wait()``, which also finishes the fp32 round trip
and the copy-back. MPICH progresses nonblocking operations inside MPI calls, so overlap with
compute is partial on CPU; correctness does not depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from mpi4py import MPI

from trainer.comm import checks
from trainer.comm.member import GroupMember
from trainer.comm.mpi.buffers import MpiHandle, Staged, nothing, vector
from trainer.comm.protocol import DoneHandle, Handle, P2POp, ReduceOp
from trainer.errors import CommError

if TYPE_CHECKING:
    from mpi4py.typing import BufSpec, InPlace

_TAG = 0  # one tag for every p2p message: pairs match in posting order, as in NCCL
_REDUCIBLE = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
)
_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN,
            ReduceOp.AVG: MPI.SUM}


class MpiCommunicator(GroupMember):
    """A `Communicator` on one ``MPI.Comm``; ranks and sizes are that communicator's."""

    backend = "mpi"

    def __init__(self, comm: MPI.Comm, name: str = "world") -> None:
        super().__init__(comm, name)
        self._comm = comm

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(
        self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle | None:
        self._check_reduce("all_reduce", t, op)
        s = Staged(t, reduce=True)
        mop = _MPI_OPS[op]
        return self._run(
            lambda: self._comm.Allreduce(MPI.IN_PLACE, s.buf, mop),
            lambda: self._comm.Iallreduce(MPI.IN_PLACE, s.buf, mop),
            lambda: self._finish_reduce(s, op), async_op,
        )

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None:
        loc = self._where()
        for t in (out, inp):
            checks.check_device("all_gather", loc, t, "cpu")
        checks.check_gather("all_gather", loc, out, inp, self._size)
        so = Staged(out)
        send: BufSpec | InPlace
        if checks.is_own_block(out, inp, self._rank) and not so.copied:
            send = MPI.IN_PLACE  # Megatron's param all-gather: the shard is a view of the buffer
        else:
            send = Staged(inp, copy=checks.overlaps(out, inp)).buf
        return self._run(
            lambda: self._comm.Allgather(send, so.buf),
            lambda: self._comm.Iallgather(send, so.buf),
            so.copy_back, async_op,
        )

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        loc = self._where()
        for t in (out, inp):
            checks.check_device("reduce_scatter", loc, t, "cpu")
        self._check_reduce("reduce_scatter", inp, op)
        checks.check_scatter("reduce_scatter", loc, out, inp, self._size)
        si = Staged(inp, reduce=True)
        so = Staged(out, reduce=True, copy=checks.overlaps(out, inp))
        mop = _MPI_OPS[op]
        return self._run(
            lambda: self._comm.Reduce_scatter_block(si.buf, so.buf, mop),
            lambda: self._comm.Ireduce_scatter_block(si.buf, so.buf, mop),
            lambda: self._finish_reduce(so, op), async_op,
        )

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        loc = self._where()
        checks.check_device("broadcast", loc, t, "cpu")
        checks.check_peer("broadcast", loc, src, self._size, "src")
        s = Staged(t)
        return self._run(
            lambda: self._comm.Bcast(s.buf, root=src),
            lambda: self._comm.Ibcast(s.buf, root=src),
            s.copy_back, async_op,
        )

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        in_splits: Sequence[int] | None = None,
        out_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None:
        loc = self._where()
        for t in (out, inp):
            checks.check_device("all_to_all", loc, t, "cpu")
        sends, recvs = checks.check_all_to_all(loc, out, inp, self._size, in_splits, out_splits)
        si = Staged(inp, copy=checks.overlaps(out, inp))
        so = Staged(out)
        row = math.prod(inp.shape[1:])  # elements per row, of the dtype MPI sees (bf16: int16)
        send, recv = vector(si.buf, sends, row), vector(so.buf, recvs, row)
        return self._run(
            lambda: self._comm.Alltoallv(send, recv),
            lambda: self._comm.Ialltoallv(send, recv),
            so.copy_back, async_op,
        )

    def barrier(self) -> None:
        self._comm.Barrier()

    # -- point to point ----------------------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int) -> None:
        loc = self._where()
        checks.check_device("send", loc, t, "cpu")
        checks.check_peer("send", loc, dst, self._size, "dst")
        self._comm.Send(Staged(t).buf, dest=dst, tag=_TAG)

    def recv(self, t: torch.Tensor, src: int) -> None:
        loc = self._where()
        checks.check_device("recv", loc, t, "cpu")
        checks.check_peer("recv", loc, src, self._size, "src")
        s = Staged(t)
        self._comm.Recv(s.buf, source=src, tag=_TAG)
        s.copy_back()

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        loc = self._where()
        for op in ops:  # check all before posting any, so a bad list posts nothing
            checks.check_p2p_kind(loc, op.kind)
            checks.check_device("batch_p2p", loc, op.tensor, "cpu")
            checks.check_peer("batch_p2p", loc, op.peer, self._size)
        handles: list[Handle] = []
        for op in ops:
            s = Staged(op.tensor)
            if op.kind == "send":
                req = self._comm.Isend(s.buf, dest=op.peer, tag=_TAG)
                handles.append(MpiHandle([req], nothing, keep=s))
            else:
                req = self._comm.Irecv(s.buf, source=op.peer, tag=_TAG)
                handles.append(MpiHandle([req], s.copy_back))
        return handles or [DoneHandle()]

    # -- groups ------------------------------------------------------------------------------

    def split(self, color: int, key: int, *, name: str = "") -> MpiCommunicator:
        checks.check_split(self._where(), color, key)
        return MpiCommunicator(self._comm.Split(color, key), name or f"{self._name}/{color}")

    def close(self) -> None:
        """Free the MPI communicator (collective); COMM_WORLD is never freed."""
        if self._comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self._comm != MPI.COMM_NULL:
            self._comm.Free()

    # -- helpers -----------------------------------------------------------------------------

    def _where(self) -> str:
        return checks.where(self.backend, self._name, self._rank, self._size)

    def _check_reduce(self, op_name: str, t: torch.Tensor, op: ReduceOp) -> None:
        loc = self._where()
        checks.check_device(op_name, loc, t, "cpu")
        checks.check_reduce(op_name, loc, t, op)
        if t.dtype not in _REDUCIBLE:
            raise CommError(
                f"{op_name} failed", loc, f"MPI has no reduction for {t.dtype}",
                "Convert the tensor to a floating-point or integer dtype first",
            )

    def _finish_reduce(self, s: Staged, op: ReduceOp) -> None:
        if op is ReduceOp.AVG:
            s.work.div_(self._size)  # in fp32 for fp16/bf16: one rounding, at the copy-back
        s.copy_back()

    @staticmethod
    def _run(
        blocking: Callable[[], None],
        nonblocking: Callable[[], MPI.Request],
        finish: Callable[[], None],
        async_op: bool,
    ) -> Handle | None:
        if not async_op:
            blocking()
            finish()
            return None
        return MpiHandle([nonblocking()], finish)
