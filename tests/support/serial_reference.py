"""The single-device run every parallel layout is compared with.

One process, the plain model of the run's family, the whole global batch (text or tokenized
data, read as the trainer reads it) in the run's microbatches (as a single device with gradient
accumulation would), torch's own clipping, in fp64 (tests/support/numerics.py).

It also measures what `adam_atol` and `loss_atol` need to know of the gradients instead of
assuming it: ``grad_scale``, the largest sum over a step's tokens of the magnitudes of each
token's part of one gradient element (Σ_t |∂ℓ_t/∂θ| / n, the mean loss dividing by n), over
every element and step. One backward pass per token on the tiny models of the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.support.numerics import U64, adam_atol, float64, loss_atol, norm_atol
from trainer.config.options import TrainConfig
from trainer.data.batches import BatchPlan
from trainer.data.sources import make_batches
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.optim.optimizer import LRSchedule, build_optimizer, set_lr
from trainer.training.startup import training_data


def train_serially(cfg: TrainConfig, steps: int, *, fp64: bool = True,
                   prepare: Callable[[GPT], None] | None = None) -> dict:
    """The losses, the gradient norms (before clipping), the final parameters and the measured
    ``grad_scale`` (above), in fp64 unless
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
    batches = make_batches(training_data(cfg), seq_len=cfg.gpt.seq_len, seed=cfg.seed,
                           plan=BatchPlan(cfg.data.global_batch, 1, cfg.parallel.microbatches),
                           dp_rank=0, device=torch.device("cpu"), reporter=False)
    opt = cfg.optimizer
    schedule = LRSchedule(lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps,
                        decay_steps=cfg.decay_end)
    losses, norms, grad_scale = [], [], 0.0
    for step in range(1, steps + 1):
        set_lr(optimizer, schedule.lr_at(step))
        micro, loss = batches.microbatches(step), torch.zeros(())
        grad_scale = max(grad_scale, token_term_scale(model, micro))
        optimizer.zero_grad()
        for x, y, *docs in micro:  # docs: the document ids under --document-mask
            part = model.loss(x, y, *docs) / len(micro)
            part.backward()
            loss += part.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)))
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "grad_scale": grad_scale}


def token_term_scale(model: GPT, micro: list[tuple[torch.Tensor, ...]]) -> float:
    """max over gradient elements of Σ_t |∂ℓ_t/∂θ| / n for the n tokens of ``micro`` (a step's
    microbatches), each token's loss ℓ_t the model's own criterion on its logits alone. A
    backward pass per token (batching them with vmap is ~10x slower on these tiny models)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    n_tokens = sum(y.numel() for _, y in micro)
    for x, y, *docs in micro:
        logits, targets = model(x, *docs).flatten(0, 1), y.flatten()
        for t in range(targets.numel()):
            part = model.criterion(logits[t:t + 1], targets[t:t + 1])
            grads = torch.autograd.grad(part, params, retain_graph=True, allow_unused=True)
            for acc, g in zip(total, grads, strict=True):
                if g is not None:
                    acc += g.abs()
    model.zero_grad(set_to_none=True)
    return max(float(acc.max()) for acc in total if acc.numel()) / n_tokens


@dataclass(frozen=True)
class Bounds:
    """What rounding alone may change in a run compared with a reference of the same model and
    data (tests/support/numerics.py), from the reference's measured gradient scale."""

    loss: float
    """each step's loss, beyond the loss's own rounding (`loss_atol`)"""
    params: float
    """each parameter element after the steps (`adam_atol`)"""
    norm: float
    """a step's gradient norm before clipping (`norm_atol`)"""


def bounds(ref: dict, *, steps: int, lr: float, n_terms: int, unit: float = U64) -> Bounds:
    """The `Bounds` after ``steps`` steps at ``lr`` whose longest sum has ``n_terms`` terms, for
    ``ref`` (a `train_serially` result, or any dict with its "params" and "grad_scale")."""
    n_params = sum(p.numel() for p in ref["params"].values())
    scale = ref["grad_scale"]
    return Bounds(
        loss=loss_atol(steps=steps, lr=lr, n_params=n_params, n_terms=n_terms, grad_scale=scale,
                       unit=unit),
        params=adam_atol(steps=steps, lr=lr, n_terms=n_terms, grad_scale=scale, unit=unit),
        norm=norm_atol(n_params=n_params, n_terms=n_terms, grad_scale=scale, unit=unit))
