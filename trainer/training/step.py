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

from trainer.optim.grad_clip import clip_grad_norm
from trainer.training import readout
from trainer.training.expert_load import step_load
from trainer.training.metrics import StepRecord
from trainer.training.readout import PendingStep
from trainer.training.run import Run


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
