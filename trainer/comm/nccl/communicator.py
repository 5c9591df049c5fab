"""`Communicator` over nccl4py (``import nccl.core``) for CUDA tensors.

nccl4py is imported lazily (`trainer.comm.nccl.setup`), so this module imports on a machine
without it or without a GPU; using the backend there raises a `BootstrapError` with the fix.

The pitfalls of nccl4py (reference/training.md §4) and how this module meets them:

* ``stream=None`` means the legacy default stream, not torch's: every call passes a stream
  handle explicitly, ``torch.cuda.current_stream().cuda_stream`` for synchronous calls.
* nccl4py does not check contiguity (a strided view would be read as if dense): non-contiguous
  tensors are staged in a contiguous copy that is copied back on the same stream.
* Sends and receives that must progress together are posted inside one ``nccl.group()``
  (`batch_p2p`), otherwise two ranks that both send first deadlock.
* The CUDA device is set before ``Communicator.init`` (bootstrap does ``torch.cuda.set_device``
  and `create` enters ``torch.cuda.device`` as well).

Asynchronous operations run on a side stream of the communicator that first waits for the
caller's current stream (so inputs are ready), and the handle is a CUDA event recorded after
them: ``wait()`` makes the caller's current stream wait for it, like ``torch.distributed``'s
``Work.wait()``; the host is not blocked. Tensors used on the side stream are marked with
``record_stream`` so the caching allocator does not reuse their memory too early.

Sub-communicators: `split` splits the MPI communicator kept alongside, then the rank 0 of each
new group creates a fresh NCCL unique id and broadcasts it over its MPI sub-communicator
(docs/design.md section 4); a failure to create the id is broadcast too, so no rank waits forever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainer.comm import checks
from trainer.comm.member import GroupMember
from trainer.comm.nccl.buffers import NcclHandle, Staged, row_slices
from trainer.comm.nccl.setup import import_nccl, nccl_version, share_unique_id
from trainer.comm.protocol import DoneHandle, Handle, P2POp, ReduceOp
from trainer.errors import CommError

if TYPE_CHECKING:  # the communicator is handed in; mpi4py is imported by bootstrap
    from mpi4py import MPI

__all__ = ["NcclCommunicator", "NcclHandle", "import_nccl", "nccl_version", "share_unique_id"]

_UNSUPPORTED = (torch.int16, torch.complex64, torch.complex128)


class NcclCommunicator(GroupMember):
    """A `Communicator` on one nccl4py ``Communicator`` plus the MPI communicator of its ranks."""

    backend = "nccl"

    def __init__(self, comm: Any, mpi_comm: MPI.Comm, device: int, name: str = "world") -> None:
        self._nccl = import_nccl()
        super().__init__(mpi_comm, name)
        self._comm = comm
        self._device = torch.device("cuda", device)
        self._side: torch.cuda.Stream | None = None

    @classmethod
    def create(cls, mpi_comm: MPI.Comm, device: int, name: str = "world") -> NcclCommunicator:
        """Collective over ``mpi_comm``: share a unique id, then ``Communicator.init``."""
        nccl = import_nccl()
        uid = share_unique_id(mpi_comm)
        with torch.cuda.device(device):
            comm = nccl.Communicator.init(
                nranks=mpi_comm.Get_size(), rank=mpi_comm.Get_rank(), unique_id=uid
            )
        return cls(comm, mpi_comm, device, name)

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(
        self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle | None:
        self._check("all_reduce", t)
        checks.check_reduce("all_reduce", self._where(), t, op)
        s = Staged(t)
        nop = self._op(op)
        return self._launch(
            lambda st: self._comm.allreduce(s.work, s.work, nop, stream=st),
            [s.user, s.work], s.copy_back, async_op,
        )

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None:
        self._check("all_gather", out, inp)
        checks.check_gather("all_gather", self._where(), out, inp, self._size)
        so = Staged(out)
        in_place = checks.is_own_block(out, inp, self._rank)
        si = Staged(inp, copy=not in_place and checks.overlaps(out, inp))
        return self._launch(
            lambda st: self._comm.allgather(si.work, so.work, stream=st),
            [so.user, so.work, si.work], so.copy_back, async_op,
        )

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        self._check("reduce_scatter", out, inp)
        checks.check_reduce("reduce_scatter", self._where(), inp, op)
        checks.check_scatter("reduce_scatter", self._where(), out, inp, self._size)
        si = Staged(inp)
        in_place = checks.is_own_block(inp, out, self._rank)  # NCCL's in-place layout
        so = Staged(out, copy=not in_place and checks.overlaps(out, inp))
        nop = self._op(op)
        return self._launch(
            lambda st: self._comm.reduce_scatter(si.work, so.work, nop, stream=st),
            [so.user, so.work, si.work], so.copy_back, async_op,
        )

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        self._check("broadcast", t)
        checks.check_peer("broadcast", self._where(), src, self._size, "src")
        s = Staged(t)
        return self._launch(
            lambda st: self._comm.broadcast(s.work, s.work, src, stream=st),
            [s.user, s.work], s.copy_back, async_op,
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
        self._check("all_to_all", out, inp)
        sends, recvs = checks.check_all_to_all(
            self._where(), out, inp, self._size, in_splits, out_splits)
        si = Staged(inp, copy=checks.overlaps(out, inp))
        so = Staged(out)
        send_rows, recv_rows = row_slices(si.work, sends), row_slices(so.work, recvs)

        def enqueue(stream: int) -> None:
            # Grouped send/recv is how NCCL does uneven all-to-all (torch's all_to_all_single
            # does the same); empty blocks post nothing, a rank's own block goes through NCCL too.
            with self._nccl.group():
                for peer in range(self._size):
                    if send_rows[peer].numel():
                        self._comm.send(send_rows[peer], peer, stream=stream)
                    if recv_rows[peer].numel():
                        self._comm.recv(recv_rows[peer], peer, stream=stream)

        return self._launch(enqueue, [so.user, so.work, si.work], so.copy_back, async_op)

    def barrier(self) -> None:
        """One-element all-reduce, then wait for it on the host (NCCL has no barrier)."""
        token = torch.zeros(1, device=self._device)
        self._comm.allreduce(token, token, self._nccl.SUM, stream=self._current())
        torch.cuda.current_stream(self._device).synchronize()

    # -- point to point ----------------------------------------------------------------------

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._check("send", t)
        checks.check_peer("send", self._where(), dst, self._size, "dst")
        self._comm.send(Staged(t).work, dst, stream=self._current())

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._check("recv", t)
        checks.check_peer("recv", self._where(), src, self._size, "src")
        s = Staged(t)
        self._comm.recv(s.work, src, stream=self._current())
        s.copy_back()

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]:
        loc = self._where()
        for op in ops:
            checks.check_p2p_kind(loc, op.kind)
            self._check("batch_p2p", op.tensor)
            checks.check_peer("batch_p2p", loc, op.peer, self._size)
        if not ops:
            return [DoneHandle()]
        staged = [(op, Staged(op.tensor)) for op in ops]

        def enqueue(stream: int) -> None:
            with self._nccl.group():  # paired sends and receives progress together
                for op, s in staged:
                    if op.kind == "send":
                        self._comm.send(s.work, op.peer, stream=stream)
                    else:
                        self._comm.recv(s.work, op.peer, stream=stream)

        def finish() -> None:
            for op, s in staged:
                if op.kind == "recv":
                    s.copy_back()

        keep = [t for _, s in staged for t in (s.user, s.work)]
        handle = self._launch_async(enqueue, keep, finish)
        return [handle] * len(ops)

    # -- groups ------------------------------------------------------------------------------

    def split(self, color: int, key: int, *, name: str = "") -> NcclCommunicator:
        checks.check_split(self._where(), color, key)
        sub = self._mpi.Split(color, key)
        return NcclCommunicator.create(sub, self._device.index, name or f"{self._name}/{color}")

    def close(self) -> None:
        """Destroy the NCCL communicator (collective over the group's ranks on each host)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

    # -- helpers -----------------------------------------------------------------------------

    def _where(self) -> str:
        return checks.where(self.backend, self._name, self._rank, self._size)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        loc = self._where()
        for t in tensors:
            checks.check_device(op, loc, t, "cuda")
            if t.device != self._device:
                raise CommError(
                    f"{op} failed", loc,
                    f"the tensor is on {t.device} but this communicator runs on {self._device}",
                    "Create tensors on torch.cuda.current_device() "
                    "(bootstrap set it from LOCAL_RANK)",
                )
            if t.dtype in _UNSUPPORTED:
                raise CommError(
                    f"{op} failed", loc, f"NCCL has no datatype for {t.dtype}",
                    "Convert the tensor (int16 to int32, complex to a real view) first",
                )

    def _op(self, op: ReduceOp) -> Any:
        return {ReduceOp.SUM: self._nccl.SUM, ReduceOp.MAX: self._nccl.MAX,
                ReduceOp.MIN: self._nccl.MIN, ReduceOp.AVG: self._nccl.AVG}[op]

    def _current(self) -> int:
        return torch.cuda.current_stream(self._device).cuda_stream

    def _launch(self, enqueue: Callable[[int], None], tensors: list[torch.Tensor],
                finish: Callable[[], None], async_op: bool) -> Handle | None:
        if not async_op:
            enqueue(self._current())
            finish()
            return None
        return self._launch_async(enqueue, tensors, finish)

    def _launch_async(self, enqueue: Callable[[int], None], tensors: list[torch.Tensor],
                      finish: Callable[[], None]) -> Handle:
        current = torch.cuda.current_stream(self._device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self._device)
        self._side.wait_stream(current)  # inputs written on the current stream are ready
        enqueue(self._side.cuda_stream)
        for t in tensors:
            t.record_stream(self._side)
        event = torch.cuda.Event()
        event.record(self._side)
        return NcclHandle(event, self._device, tensors, finish)
