"""Optimizer and learning-rate schedule.

AdamW with weight decay on matrices only (embeddings and linear weights); norms and biases are
not decayed (the GPT-2/nanoGPT convention). The schedule is linear warmup to ``lr`` then a
cosine decay to ``min_lr`` at ``decay_steps``, flat afterwards. ``lr_at`` is a pure function of
the step, so a resumed run gets the same learning rates without saving scheduler state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.gpu.settings import adamw_kernel


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Warmup + cosine learning-rate schedule (steps are 1-based: step 1 is the first update)."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    def lr_at(self, step: int) -> float:
        """Learning rate of update number ``step`` (>= 1)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = (step - self.warmup_steps) / span
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(params: Iterable[nn.Parameter], weight_decay: float
                 ) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed (>= 2-D tensors) and not decayed (norm weights, biases)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module | Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8
                    ) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (or over the given parameters: the fp32 main
    copies of `trainer.optim.mixed_precision`): fused on CUDA, the per-tensor loop elsewhere
    (`trainer.gpu.settings`), each deterministic for a fixed device, which bit-exact resume
    needs."""
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    return torch.optim.AdamW(param_groups(params, weight_decay), lr=lr, betas=betas, eps=eps,
                             **adamw_kernel(params))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
