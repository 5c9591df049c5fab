"""One optimizer step of a training run, the same on every layout: seeds, the body's forward
and backward, gradient sync, clipping, the guard, the update (`trainer.train` runs the loop
around it). What differs between layouts was chosen when the run was built: the body
(`trainer.training.body`) and the holder of the main weights (`trainer.optim.main_weights`).

The dropout seeds come from (seed, step, dp rank), and the pp rank under PP, alone, so the
random stream needs no state across a resume; the TP stream also mixes in the tp rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.comm.mesh import Mesh
from trainer.data.batches import step_seed
from trainer.optim.grad_clip import clip_grad_norm
from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker
from trainer.training import readout
from trainer.training.expert_load import step_load
from trainer.training.metrics import StepRecord
from trainer.training.readout import PendingStep

if TYPE_CHECKING:
    from trainer.training.run import Run

_DROPOUT_STREAM = 1
_TP_DROPOUT_STREAM = 2


@dataclass(frozen=True)
class DropoutSeeds:
    """Where a step's dropout streams start: (seed, step, dp rank[, pp rank]), the TP stream
    with the tp rank too."""

    seed: int
    dp_rank: int
    tp_rank: int
    stage: tuple[int, ...]
    """(pp rank,) under PP, else () so that runs without it keep their random streams."""

    @classmethod
    def of(cls, seed: int, mesh: Mesh, *, pipelined: bool) -> DropoutSeeds:
        return cls(seed, mesh.rank("dp"), mesh.rank("tp"), (mesh.rank("pp"),) if pipelined
                   else ())

    def reseed(self, step: int, tracker: RNGStatesTracker) -> None:
        torch.manual_seed(step_seed(self.seed, step, _DROPOUT_STREAM, self.dp_rank, *self.stage))
        tracker.seed(TP_RNG, step_seed(self.seed, step, _TP_DROPOUT_STREAM, self.dp_rank,
                                       self.tp_rank, *self.stage))


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step (all microbatches), its loss and norm read at once (the probes'
    entry; the training loop reads a logging interval of `run_step`s together)."""
    return readout.read([run_step(run, step)])[0]


def run_step(run: Run, step: int) -> PendingStep:
    """One optimizer step (all microbatches); returns rank 0's view of it, loss and gradient
    norm still on the device: the step's one host read is the guard's finite check."""
    run.clock.take()  # what ran between steps (evaluation, checkpoints) is not the step's
    start = time.perf_counter()
    run.seeds.reseed(step, run.tracker)
    run.dp.zero_grad()
    loss_sum = run.body.forward_backward(run.batches.microbatches(step))
    with run.clock.blocked():
        run.dp.finish_grad_sync()
    run.body.sum_shared_grads(run.weights)
    grad_norm = clip_grad_norm(run.weights.grads(), run.cfg.optimizer.grad_clip,
                               run.norm_scope)
    loss = run.body.reduce_loss(loss_sum)
    lr = run.lr_schedule.lr_at(step)
    if run.guard.admit(step, loss, grad_norm, report=run.is_writer):  # every rank alike
        run.weights.step(lr)
    load = step_load(run.model, run.mesh.group("dp_cp"))  # every token of the step
    step_s = time.perf_counter() - start
    exposed, total = run.clock.take()
    record = StepRecord(step=step, loss=math.nan, lr=lr, grad_norm=math.nan,
                        tokens=run.cfg.data.global_batch * run.cfg.gpt.seq_len, step_s=step_s,
                        compute_s=step_s - exposed, comm_exposed_s=exposed, comm_total_s=total,
                        moe=load)
    return PendingStep(loss, grad_norm, record)
