"""``--time-limit S``: stop training after S seconds, with a checkpoint, like a last step.

For jobs that must end within a scheduler's wall-time limit, and runs measured in time rather
than steps. Every rank must stop after the same step (the next step's collectives would
otherwise wait forever for the ranks that left), and their clocks disagree by a little, so
every ``--log-every`` steps the ranks agree with one all-reduce (MAX) of "my time is up" over
the world: one small collective per log interval, none in between. The clock starts when the
training loop does (after start-up, data loading and model construction).
"""

from __future__ import annotations

import time

import torch

from trainer.comm.protocol import Communicator, ReduceOp


class TimeLimit:
    def __init__(self, seconds: float, comm: Communicator, every: int,
                 device: torch.device) -> None:
        self.seconds, self.comm, self.every, self.device = seconds, comm, every, device
        self.started = time.monotonic()

    def reached(self, step: int) -> bool:
        """True on every rank, after the same ``step``, once some rank has trained for the
        limit (checked every ``every`` steps; never without a limit)."""
        if not self.seconds or step % self.every:
            return False
        up = torch.tensor([float(time.monotonic() - self.started >= self.seconds)],
                          device=self.device)
        self.comm.all_reduce(up, ReduceOp.MAX)
        return bool(up.item())
