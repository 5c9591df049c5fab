"""What the NCCL communicator hands to nccl4py: contiguous tensors, row blocks, event handles.

nccl4py does not check contiguity (a strided view would be read as if dense), so a
non-contiguous tensor is `Staged` in a contiguous copy that is copied back on the same stream.
An `NcclHandle` is a CUDA event recorded after work on the side stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class NcclHandle:
    """Work enqueued on the side stream; ``wait()`` orders the current stream after it."""

    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: object,
                 finish: Callable[[], None]) -> None:
        self._event: torch.cuda.Event | None = event
        self._device, self._keep, self._finish = device, keep, finish

    def wait(self) -> None:
        if self._event is None:
            return
        torch.cuda.current_stream(self._device).wait_event(self._event)
        self._finish()  # copy-back of staged tensors, on the current stream after the event
        self._event = self._keep = None

    def is_completed(self) -> bool:
        return self._event is None or bool(self._event.query())


class Staged:
    """A contiguous tensor NCCL can take, and the copy back to a strided original."""

    def __init__(self, t: torch.Tensor, *, copy: bool = False) -> None:
        self.user = t.detach()
        contiguous = self.user.is_contiguous() and not copy
        self.work = self.user if contiguous else self.user.clone(
            memory_format=torch.contiguous_format)

    def copy_back(self) -> None:
        if self.work is not self.user:
            self.user.copy_(self.work)


def row_slices(t: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive dim-0 blocks of a contiguous tensor (each contiguous too)."""
    return list(torch.split(t, list(rows), dim=0))
