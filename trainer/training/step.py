"""One optimizer step of a training run, on every layout: seeds, microbatches, gradient sync,
clipping, the guard, the optimizer (`trainer.train` runs the loop around it).

The dropout seeds come from (seed, step, dp rank), and the pp rank under PP, alone, so the
random stream needs no state across a resume; the TP stream also mixes in the tp rank.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

from trainer.comm.protocol import ReduceOp
from trainer.data.batches import step_seed
from trainer.optim.grad_clip import clip_grad_norm
from trainer.optim.optimizer import set_lr
from trainer.tensor_parallel.random import TP_RNG
from trainer.training import readout
from trainer.training.expert_load import step_load
from trainer.training.metrics import StepRecord
from trainer.training.readout import PendingStep
from trainer.training.run import Run

_DROPOUT_STREAM = 1
_TP_DROPOUT_STREAM = 2


def train_step(run: Run, step: int) -> StepRecord:
    """One optimizer step (all microbatches), its loss and norm read at once (the probes'
    entry; the training loop reads a logging interval of `run_step`s together)."""
    return readout.read([run_step(run, step)])[0]


def run_step(run: Run, step: int) -> PendingStep:
    """One optimizer step (all microbatches); returns rank 0's view of it, loss and gradient
    norm still on the device: the step's one host read is the guard's finite check."""
    run.clock.take()  # what ran between steps (evaluation, checkpoints) is not the step's
    start = time.perf_counter()
    # The pp rank joins the seeds only under PP, so runs without it keep their random streams.
    mesh = run.mesh
    stage = (mesh.rank("pp"),) if run.pipeline is not None else ()
    torch.manual_seed(step_seed(run.cfg.seed, step, _DROPOUT_STREAM, mesh.rank("dp"), *stage))
    run.tracker.seed(TP_RNG, step_seed(run.cfg.seed, step, _TP_DROPOUT_STREAM, mesh.rank("dp"),
                                       mesh.rank("tp"), *stage))
    lr = run.schedule.lr_at(step)
    set_lr(run.optimizer, lr)
    run.dp.zero_grad()
    micro = run.batches.microbatches(step)
    if run.pipeline is not None:
        loss_sum = run.pipeline.forward_backward(micro)
    else:
        loss_sum = _accumulate(run, micro)
    with run.clock.blocked():
        run.dp.finish_grad_sync()
    if run.zero is not None and run.pipeline is not None:
        run.zero.sync_tied_grads(run.pipeline.embd, run.pipeline.tied)
    elif run.pipeline is not None:
        run.pipeline.sync_tied_grads()
    params, scope = (run.main.grads(), run.main.scope(run.norm_scope)) if run.main else (
        run.dp.params, run.norm_scope)
    grad_norm = clip_grad_norm(params, run.cfg.optimizer.grad_clip, scope)
    if run.pipeline is not None:
        loss = run.pipeline.reduce_loss(loss_sum, run.dp.comm)
    else:
        run.dp.comm.all_reduce(loss_sum, ReduceOp.AVG)  # the logged loss is the global batch's
        loss = loss_sum
    if run.guard.admit(step, loss, grad_norm, report=run.is_writer):  # every rank alike
        run.optimizer.step()
        if run.zero is not None:
            with run.clock.blocked():  # ZeRO-1's all-gather: the next forward needs it
                run.zero.publish()
        elif run.main is not None:
            run.main.publish()
    load = step_load(run.model, run.dp.comm)
    step_s = time.perf_counter() - start
    exposed, total = run.clock.take()
    record = StepRecord(step=step, loss=math.nan, lr=lr, grad_norm=math.nan,
                        tokens=run.cfg.data.global_batch * run.cfg.gpt.seq_len, step_s=step_s,
                        compute_s=step_s - exposed, comm_exposed_s=exposed, comm_total_s=total,
                        moe=load)
    return PendingStep(loss, grad_norm, record)


def _accumulate(run: Run, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Forward and backward of every microbatch, DP-synchronised on the last one only."""
    loss_sum = torch.zeros((), device=run.dp.buffer.device)
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        with nullcontext() if last else run.dp.no_sync():
            # Mean over the step's tokens = mean over microbatches of microbatch means.
            loss = run.model.loss(x, y) / len(micro)
            loss.backward()
        loss_sum += loss.detach()
    return loss_sum
