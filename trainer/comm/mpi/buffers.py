"""What the MPI communicator hands to mpi4py: staged tensors, request handles, vector specs.

A `Staged` tensor is the user's tensor as MPI sees it: contiguous, fp16/bf16 upcast to fp32
when reduced (moved bit for bit as int16 otherwise), with the copy back into the user's tensor
that completes an operation. An `MpiHandle` keeps the nonblocking requests and every staging
buffer alive until ``wait()``.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

if TYPE_CHECKING:
    from mpi4py.typing import BufSpecV

UPCAST = (torch.float16, torch.bfloat16)
_AS_INT16 = (torch.float16, torch.bfloat16)  # moved bit for bit, never reduced as-is


class _Holding(np.ndarray):
    """A numpy view that keeps the tensor whose memory it shows alive (``tensor``)."""

    tensor: torch.Tensor


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array over contiguous CPU tensor ``t``'s memory that leaves its storage
    resizable: ``t.numpy()`` marks the storage not resizable for good, and ZeRO-3 gathers a
    unit straight into a buffer whose storage it frees (resizes to 0) after use
    (`trainer.parallel.zero.units`). The array holds ``t``, as ``t.numpy()`` does, so a
    staging copy lives as long as MPI may use it."""
    if t.numel() == 0:
        return t.numpy()
    dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
    raw = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    flat: np.ndarray = np.frombuffer(memoryview(raw).cast("B"), dtype=dtype)
    held = flat.reshape(t.shape).view(_Holding)
    held.tensor = t
    return held


class Staged:
    """A tensor as MPI sees it (contiguous, a dtype MPI handles) and the way back to the user's."""

    def __init__(self, t: torch.Tensor, *, reduce: bool = False, copy: bool = False) -> None:
        self.user = t.detach()
        if reduce and self.user.dtype in UPCAST:
            self.work = self.user.to(torch.float32, memory_format=torch.contiguous_format)
        elif copy or not self.user.is_contiguous():
            self.work = self.user.clone(memory_format=torch.contiguous_format)
        else:
            self.work = self.user
        self.copied = self.work is not self.user
        moved = self.work.view(torch.int16) if self.work.dtype in _AS_INT16 else self.work
        self.buf = numpy_view(moved)

    def copy_back(self) -> None:
        if self.copied:
            self.user.copy_(self.work)


class MpiHandle:
    """Nonblocking MPI requests plus the step that completes the result (copy-back, AVG)."""

    def __init__(
        self, requests: list[MPI.Request], finish: Callable[[], None], keep: object = None
    ) -> None:
        self._requests = requests
        self._finish: Callable[[], None] | None = finish
        self._keep = keep  # buffers MPI still reads (a send's staging copy)

    def wait(self) -> None:
        if self._finish is None:
            return
        MPI.Request.Waitall(self._requests)
        finish, self._finish = self._finish, None
        finish()
        self._requests, self._keep = [], None  # drop the buffers only once MPI is done

    def is_completed(self) -> bool:
        return self._finish is None or MPI.Request.Testall(self._requests)


def vector(buf: Any, rows: Sequence[int], row: int) -> BufSpecV:
    """``buf`` with per-member element counts and displacements, as ``Alltoallv`` takes them."""
    counts = [n * row for n in rows]
    displs = list(itertools.accumulate(counts, initial=0))[:-1]
    return (buf, (counts, displs))


def nothing() -> None:
    return None
