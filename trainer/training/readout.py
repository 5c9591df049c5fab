"""Steps whose loss and gradient norm stay on the device until the log interval reads them.

Reading a CUDA tensor on the host (``.item()``, ``float()``, ``.tolist()``) waits for every
kernel queued before it, so the host can no longer run ahead of the GPU. A step therefore
keeps its loss (accumulated over the microbatches as a tensor) and its gradient norm on the
device (`PendingStep`); `read` turns a whole logging interval of them into `StepRecord`s with
one transfer. The only read inside a step is the one bool the divergence guard needs before
the optimizer may step (`trainer.training.guard`), as Megatron reads its found-inf flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from trainer.training.metrics import StepRecord


@dataclass(frozen=True)
class PendingStep:
    """A finished step whose loss and gradient norm (0-d tensors) have not been read yet;
    ``record`` holds everything else (its loss and grad_norm fields are NaN until `read`)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    record: StepRecord


def read(steps: Sequence[PendingStep]) -> list[StepRecord]:
    """The records of ``steps``, their losses and norms read in one device-to-host copy."""
    if not steps:
        return []
    pairs = torch.stack([torch.stack([s.loss.detach().double().reshape(()),
                                      s.grad_norm.detach().double().reshape(())])
                         for s in steps])
    values = pairs.cpu().tolist()
    return [replace(s.record, loss=loss, grad_norm=norm)
            for s, (loss, norm) in zip(steps, values, strict=True)]
