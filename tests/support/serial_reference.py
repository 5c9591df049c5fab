"""The single-device run every parallel layout is compared with.

One process, the plain model of the run's family, the whole global batch in the run's
microbatches (as a single device with gradient accumulation would), torch's own clipping, in
fp64 (tests/support/numerics.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.support.numerics import float64
from trainer.config.options import TrainConfig
from trainer.data.batches import BatchPlan, ShardedBatches
from trainer.data.corpus import load_corpus
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.optim.optimizer import LRSchedule, build_optimizer, set_lr


def train_serially(cfg: TrainConfig, steps: int, *, fp64: bool = True,
                   prepare: Callable[[GPT], None] | None = None) -> dict:
    """The losses, the gradient norms (before clipping) and the final parameters, in fp64 unless
    ``fp64`` is False (the fp32 run users get; fp64 draws other initial weights from a seed).
    ``prepare`` may change the model before training (e.g. point MoE layers at a reference)."""
    if not fp64:
        return _train(cfg, steps, prepare)
    with float64():
        return _train(cfg, steps, prepare)


def _train(cfg: TrainConfig, steps: int, prepare: Callable[[GPT], None] | None) -> dict:
    model = build_model(cfg.gpt, seed=cfg.seed)  # the GPT or the Llama
    if prepare is not None:
        prepare(model)
    optimizer = build_optimizer(model, lr=cfg.optimizer.lr,
                                weight_decay=cfg.optimizer.weight_decay)
    corpus = load_corpus(cfg.data.path, cap_bytes=int(cfg.data.data_cap_mb * 2**20))
    batches = ShardedBatches(corpus, seq_len=cfg.gpt.seq_len,
                             plan=BatchPlan(cfg.data.global_batch, 1, cfg.parallel.microbatches),
                             seed=cfg.seed, dp_rank=0)
    opt = cfg.optimizer
    schedule = LRSchedule(lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps,
                        decay_steps=cfg.decay_end)
    losses, norms = [], []
    for step in range(1, steps + 1):
        set_lr(optimizer, schedule.lr_at(step))
        optimizer.zero_grad()
        micro, loss = batches.microbatches(step), torch.zeros(())
        for x, y in micro:
            part = model.loss(x, y) / len(micro)
            part.backward()
            loss += part.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)))
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}
