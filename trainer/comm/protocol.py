"""The one communication interface every parallel algorithm in the trainer is written against.

Two backends implement it: `trainer.comm.mpi.communicator.MpiCommunicator` (torch CPU tensors over
mpi4py, used for CPU runs and every test) and `trainer.comm.nccl.communicator.NcclCommunicator`
(CUDA tensors over nccl4py). Code above this protocol (DP buckets, TP layers, PP schedules) never
names a backend, so an algorithm tested on CPU runs unchanged on GPUs.

Semantics shared by both backends (they are the ones of ``torch.distributed`` and NCCL):

* Collectives are called by every member of the communicator, in the same order.
* ``all_reduce`` and ``broadcast`` work in place. ``all_gather``, ``reduce_scatter`` and
  ``all_to_all`` split or concatenate along dim 0 into blocks, block ``i`` belonging to the
  member of rank ``i``. The blocks are equal except in ``all_to_all`` given ``in_splits`` /
  ``out_splits`` (rows sent to / received from each member, zeros allowed; like
  ``torch.distributed.all_to_all_single``): member ``i``'s ``in_splits[j]`` must equal member
  ``j``'s ``out_splits[i]``, which callers ensure by exchanging counts first.
* ``async_op=True`` returns a `Handle`; the result may be read only after ``handle.wait()``, and
  the tensors must stay untouched until then. On MPI ``wait()`` blocks the host until done; on
  NCCL it orders the caller's current CUDA stream after the operation (like ``torch.distributed``).
  ``handle.is_completed()`` polls without blocking.
* Point-to-point messages between one pair of ranks are matched in the order they were posted.
  ``batch_p2p`` posts all its operations together, so sends and receives that pair up across ranks
  never deadlock whatever their order in the list.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch


class ReduceOp(enum.Enum):
    """Reductions both backends offer. AVG is defined for floating-point tensors only."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    AVG = "avg"


@runtime_checkable
class Handle(Protocol):
    """An operation in flight; ``wait()`` completes it (idempotent).

    ``is_completed()`` never blocks: True once ``wait()`` would return at once. On MPI each call
    also advances the operation (MPI progresses only inside library calls), so polling it with
    sleeps keeps a core free where a blocking ``wait()`` would spin.
    """

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class DoneHandle:
    """A handle for work that already finished (e.g. an empty batch)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a `Communicator.batch_p2p` call.

    ``peer`` is a rank of that communicator.
    """

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class Vote(Protocol):
    """A non-blocking MAX of one small integer over every rank, read a step after it was posted
    (`trainer.comm.mpi.vote.LateMax`): `post` then `result`, in turn, on every rank alike."""

    def post(self, value: int) -> None: ...

    def result(self) -> int: ...


class Agreement(Protocol):
    """A `Vote` of several integers (`trainer.comm.mpi.vote.LateMax` of a ``width``): every
    value's MAX, posted now and read later."""

    def post(self, value: int, *more: int) -> None: ...

    def results(self) -> list[int]: ...

    def close(self) -> None: ...


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks and the operations they run together.

    ``rank`` and ``size`` are this communicator's (a sub-communicator numbers its members from 0);
    ``name`` says which group it is ("world", "tp", ...) and ``backend`` is "mpi" or "nccl".
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def backend(self) -> str: ...

    def all_reduce(
        self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Handle | None: ...

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False
    ) -> Handle | None: ...

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle | None: ...

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None: ...

    def send(self, t: torch.Tensor, dst: int) -> None: ...

    def recv(self, t: torch.Tensor, src: int) -> None: ...

    def batch_p2p(self, ops: Sequence[P2POp]) -> list[Handle]: ...

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        in_splits: Sequence[int] | None = None,
        out_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Handle | None: ...

    def barrier(self) -> None: ...

    def split(self, color: int, key: int, *, name: str = "") -> Communicator: ...


def wait_quietly(handle: Handle | None, interval: float = 2e-4, *,
                 hurry: threading.Event | None = None, longest: float = 0.0) -> None:
    """Wait for ``handle`` by polling it with short sleeps (each poll advances it on MPI): a
    blocking wait on MPI spins a core, which ranks sharing the cores need while this one waits
    for them (a checkpoint's agreements: measured at dp 2 x tp 2 x pp 2 on 2 cores, ranks done
    writing spun while the others wrote, and 7 ranks spun while the leader committed; DP's comm
    thread while backward computes). Once ``hurry`` is set (nothing is left to compute) or with
    ``interval`` 0 it blocks instead. ``longest`` (above ``interval``): each sleep doubles up
    to it, for a wait that may be long and whose end nothing urgent follows (polling every
    0.2 ms costs 5.5 ms of a core per 100 ms waited, measured on the development VM; every
    1 ms, 1.4)."""
    if handle is None:
        return
    while interval > 0 and not handle.is_completed():
        if hurry is None:
            time.sleep(interval)
        elif hurry.wait(interval):
            break
        interval = min(interval * 2, max(interval, longest))
    handle.wait()


def wait_all(handles: Sequence[Handle | None]) -> None:
    """Wait for every handle (``None`` entries, from synchronous calls, are skipped)."""
    for handle in handles:
        if handle is not None:
            handle.wait()
