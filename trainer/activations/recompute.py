"""Activation recomputation, ``--recompute {none,selective,full}`` (Megatron's two modes).

* ``full``: each transformer block keeps only its input; its forward runs again in backward.
  Activation memory per block falls from O(B·T·D·(~16) + B·H·T²) to O(B·T·D).
* ``selective`` (Korthikanti et al. 2022): only the attention core, softmax(QKᵀ), its dropout
  and the product with V, is recomputed: it holds the O(B·H·T²) tensors yet costs few FLOPs.

Both run through `trainer.parallel.tensor.random.checkpoint`, which puts the default generator
*and* every tracked stream (the TP stream of attention and sequence-parallel dropout) back as
they were in forward, so recomputed dropout masks equal the original ones. The hooks are the
model's own (``Block.runner``, ``Attention.core_runner``), so recomputation happens wherever
a block runs: a plain step, and every pipeline schedule's forward and backward actions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from trainer.model.gpt import GPT
from trainer.parallel.tensor.random import RNGStatesTracker, checkpoint


def _recomputed(tracker: RNGStatesTracker, fn: Callable[..., torch.Tensor], *args: torch.Tensor
                ) -> torch.Tensor:
    return checkpoint(fn, tracker, *args)


def apply_recompute(model: GPT, mode: str, tracker: RNGStatesTracker) -> GPT:
    """Make ``model``'s blocks (``full``) or attention cores (``selective``) recompute their
    activations in backward, in place; ``none`` leaves it as it is."""
    runner = partial(_recomputed, tracker)
    for _, block in model.layers():
        if mode == "full":
            block.runner = runner
        elif mode == "selective":
            block.attn.core_runner = runner  # type: ignore[assignment]  # Attention's hook
    return model
