"""What holds the weights AdamW steps, chosen once when a run is built (`trainer.training.run`):

* `PlainWeights`: the model's own fp32 (or fp64) parameters; DP's buffer is their ``.grad``;
* `trainer.optim.mixed_precision.MainParams`: fp32 main copies of a bf16 model (``--precision
  bf16``), rounded into the model after each step;
* `trainer.parallel.zero.ZeroOptimizer`: ZeRO-1's pieces, this DP rank's share of every parameter
  (``--zero 1``), all-gathered into the model after each step.

All three have the `MainWeights` interface, so a training step is written once
(`trainer.training.step.run_step`): clip ``grads()``, then ``step()``. Every stepped tensor
carries its parameter's ``.placement`` (`trainer.placement`): the gradient norm counts it where
it leads, and a checkpoint saves and restores it at any layout (``publish`` then brings the
model's parameters to the restored weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch
from torch import nn

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.optim.optimizer import set_lr


class MainWeights(Protocol):
    """The weights one rank's optimizer steps, and how their gradients are found."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def grads(self) -> list[nn.Parameter]:
        """The stepped weights, each with its DP-synchronised gradient as ``.grad``."""
        ...

    def step(self, lr: float) -> None:
        """One AdamW update at ``lr``, then the model's parameters follow the stepped weights."""
        ...

    def sum_grad(self, param: nn.Parameter, group: Communicator) -> None:
        """Sum the DP-synchronised gradient of ``param`` over ``group`` (a weight two pipeline
        stages hold: the tied embedding)."""
        ...

    def values(self) -> Iterable[torch.Tensor]:
        """The stepped weights' values (checked before a save)."""
        ...

    def publish(self) -> None:
        """The model's parameters follow the stepped weights (after a restore)."""
        ...


class PlainWeights:
    """The model's parameters themselves: AdamW steps them in place."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params, self._optimizer = params, optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def grads(self) -> list[nn.Parameter]:
        return self.params

    def step(self, lr: float) -> None:
        set_lr(self._optimizer, lr)
        self._optimizer.step()

    def sum_grad(self, param: nn.Parameter, group: Communicator) -> None:
        sum_main_grad(param, group)

    def values(self) -> Iterable[torch.Tensor]:
        return self.params

    def publish(self) -> None:
        """Nothing: the stepped weights are the parameters."""


def sum_main_grad(param: nn.Parameter, group: Communicator) -> None:
    """All-reduce ``param``'s main gradient (the DP buffer's view) over ``group``; a parameter
    whose ``.grad`` is a separate copy gets the sum too."""
    grad = cast(torch.Tensor, getattr(param, "main_grad", param.grad))  # DP gave it one
    group.all_reduce(grad, ReduceOp.SUM)
    if param.grad is not None and param.grad.data_ptr() != grad.data_ptr():
        param.grad.copy_(grad)
