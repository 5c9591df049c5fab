"""The body of a training step, chosen once when a run is built: plain gradient accumulation
(`Accumulation`, here) or a pipeline schedule (`trainer.training.pipeline_step.Pipeline`).
Both have the `StepBody` interface, so `trainer.training.step.run_step` reads straight through.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import torch

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.data.batches import Microbatch
from trainer.model.gpt import GPT
from trainer.optim.main_weights import MainWeights
from trainer.parallel.data.split import GradSync

Microbatches = Sequence[Microbatch]


class StepBody(Protocol):
    """Forward and backward of a step's microbatches on one rank, and what follows them."""

    def forward_backward(self, micro: Microbatches) -> torch.Tensor:
        """Run every microbatch; returns this rank's loss sum, left on the device."""
        ...

    def sum_shared_grads(self, weights: MainWeights) -> None:
        """After DP's reduction: sum the gradients of weights held on several ranks."""
        ...

    def reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global batch's loss on every rank (0-d, on the device)."""
        ...

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, *docs: torch.Tensor
                  ) -> torch.Tensor | None:
        """A microbatch's mean loss in evaluation (None on ranks that compute no loss);
        ``docs``: its document ids under ``--document-mask``."""
        ...

    def report(self, run_dir: Path, *, write: bool) -> str:
        """What the body says at the end of a run ("" for nothing); collective over its
        group."""
        ...


class Accumulation:
    """Every microbatch's forward and backward in turn, DP-synchronised on the last one only."""

    def __init__(self, model: GPT, dp: GradSync, dp_group: Communicator) -> None:
        self.model, self.dp, self.dp_group = model, dp, dp_group

    def forward_backward(self, micro: Microbatches) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.dp.buffer.device)
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            with nullcontext() if last else self.dp.no_sync():
                # Mean over the step's tokens = mean over microbatches of microbatch means.
                loss = self.model.loss(*batch) / len(micro)
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def sum_shared_grads(self, weights: MainWeights) -> None:
        """Nothing: the whole model is on this rank."""

    def reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        self.dp_group.all_reduce(loss_sum, ReduceOp.AVG)  # the logged loss is the global batch's
        return loss_sum

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, *docs: torch.Tensor
                  ) -> torch.Tensor:
        return self.model.loss(x, y, *docs)

    def report(self, run_dir: Path, *, write: bool) -> str:
        return ""
