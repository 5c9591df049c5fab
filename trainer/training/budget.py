"""``--memory-budget`` held to the trainer's own accounting while the run trains.

The layout was checked against the expected bytes before the model was built
(`trainer.plan.budget.check_budget`); after every step each rank measures what it holds
(`trainer.parallel.zero.memory.held_bytes`: its parameters, or ZeRO-3's parameter shards, its
gradient buffer or shards, the optimizer's main weights and state) plus the most it held on
top during the step (ZeRO-2/3's staged gradient buckets, ZeRO-3's gathered units). The
largest rank's bytes are agreed with one MAX over the world, so every rank stops together with
the same error and only rank 0 prints it. Chosen once where the run is built: without a
budget there is no meter and no collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.comm.protocol import ReduceOp
from trainer.parallel.zero.memory import MIB
from trainer.plan.budget import budget_bytes, over_budget

if TYPE_CHECKING:
    from trainer.training.run import Run


class BudgetMeter:
    """Measures a rank's model-state bytes after each step and stops a run over budget."""

    def __init__(self, run: Run, cap: int) -> None:
        self.run, self.cap = run, cap
        self.units = getattr(run.weights, "units", None)
        """ZeRO-3's `ParamUnits`: its shards are the parameters a rank holds."""
        self.peak = 0
        """The largest rank's most bytes in a step so far."""

    @classmethod
    def of(cls, run: Run) -> BudgetMeter | None:
        cap = budget_bytes(run.cfg)
        return cls(run, cap) if cap else None

    def measure(self) -> int:
        """This rank's bytes at the peak of the step just done (and reset that peak)."""
        from trainer.training.plan_check import measured_bytes

        held = measured_bytes(self.run, saved_peak=0)  # activations not counted
        if self.units is not None:
            self.units.peak_gathered_bytes = self.units.gathered_bytes
        return held

    def after_step(self, step: int) -> None:
        """Agree on the largest rank's bytes; over the budget, every rank raises."""
        most = torch.tensor([self.measure()], dtype=torch.int64, device=self.run.mesh.device)
        world = self.run.mesh.group()
        world.all_reduce(most, ReduceOp.MAX)
        self.peak = max(self.peak, int(most.item()))
        if self.peak > self.cap:
            bf16 = next(self.run.model.parameters()).dtype == torch.bfloat16
            raise over_budget(self.run.cfg, f"held {self.peak / MIB:.2f} MiB at the peak of "
                              f"step {step} (measured)", bf16=bf16
                              ).everywhere(report=self.run.mesh.rank() == 0)
