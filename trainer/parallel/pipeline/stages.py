"""GPT pipeline stages: one rank's part of the plain GPT, and the `Stage` the runtime drives.

`build_stage_model` builds the *whole* plain GPT from the run's seed (so every parameter starts
exactly as in the serial model) and deletes what this pipeline rank does not run: the blocks of
other stages, the embedding unless the rank runs stage 0, the final norm and head unless it
runs the last stage. What is left is still a `GPT` with global parameter names
(``blocks.5.attn.qkv.weight``), so `trainer.parallel.tensor.parallelize`, `DataParallel`, the
optimizer and the checkpoint shards work on it unchanged. Training calls it on the meta device
(`trainer.construction`), so the whole model is never allocated there. With ``v`` virtual
chunks the rank keeps the blocks of all its chunks in one module; `GPTStage` runs the right
ones per chunk.

Tied embeddings (Megatron's rule): the first stage holds ``tok_emb.weight``, the last stage a
copy as ``head.weight`` (a separate parameter: they live on different ranks). Both start equal;
after backward their gradients are summed over the embedding group (first and last stage,
`trainer.training.pipeline_step`) so both get the serial model's gradient and stay identical
through every optimizer step; the global gradient norm counts the weight on the first stage
only.

`GPTStage.forward` runs one (microbatch, chunk): stage 0 embeds the microbatch's tokens, other
stages take the received activation as a fresh leaf (``detach().requires_grad_()``) so its
gradient can be sent back; the last stage returns the microbatch's loss (`GPT.head_loss`, the
one loss of every layout, padded vocabulary rows masked) divided by the number of microbatches
(the step's loss is their sum, as with gradient accumulation). The output keeps its autograd
graph until `GPTStage.backward` runs it, so each forward's activations live exactly from its F
to its B. The backward of a chunk's last microbatch runs with DP gradient
synchronisation on (the `grad_sync` hook), every other one inside ``no_sync``: each DP bucket
is then all-reduced once per step, right after the last backward of its parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch
from torch import nn

from trainer.model.config import GPTConfig
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.parallel.pipeline.partition import StageLayout

Batch = Sequence[tuple[torch.Tensor, ...]]
"""The step's microbatches: (inputs, targets[, document ids]) (`trainer.data.batches`)."""


def build_stage_model(cfg: GPTConfig, seed: int, layout: StageLayout) -> GPT:
    """The plain GPT built from ``seed``, cut down to the chunks of ``layout.rank``."""
    model = build_model(cfg, seed=seed)
    keep = {str(i) for i in layout.owned_layers()}
    for key in [k for k in model.blocks if k not in keep]:
        del model.blocks[key]
    if cfg.tied and layout.holds_last and not layout.holds_first:
        # The head's weight *is* the embedding's in the serial model; here it becomes a copy
        # of equal value, kept equal by the embedding-group gradient sum.
        head, emb = cast(nn.Linear, model.head), cast(nn.Embedding, model.tok_emb)  # built whole
        head.weight = nn.Parameter(emb.weight.detach().clone())
    if not layout.holds_first:
        model.tok_emb = None
    if not layout.holds_last:
        model.ln_f = None
        model.head = None
    return model


def tied_weight(model: GPT, layout: StageLayout) -> nn.Parameter | None:
    """The tied embedding weight this rank holds (first stage: the embedding; last stage: the
    head's copy), or ``None`` when the model is untied or the rank holds neither. Ask after
    `trainer.parallel.tensor.parallelize`, which replaces the head (and so its weight) by a TP
    shard."""
    if not model.cfg.tied:
        return None
    # The embedding and the head (or their TP shards) hold their weights as Parameters, which
    # torch's stubs type as Tensors.
    if layout.holds_first:
        return cast(nn.Parameter, cast(nn.Module, model.tok_emb).weight)
    if layout.holds_last:
        return cast(nn.Parameter, cast(nn.Module, model.head).weight)
    return None


class GPTStage:
    """The `trainer.parallel.pipeline.runtime.Stage` of one rank: runs its GPT chunks per
    microbatch."""

    def __init__(self, model: GPT, layout: StageLayout, *,
                 grad_sync: Callable[[bool], AbstractContextManager[None]] | None = None
                 ) -> None:
        self.model, self.layout = model, layout
        self.grad_sync = grad_sync or (lambda _final: nullcontext())
        self.batch: Batch = ()
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._backwards: dict[int, int] = {}

    def begin_step(self, batch: Batch) -> None:
        """The step's microbatches (inputs, targets); every rank of the pipeline computes the
        same ones (they depend on seed, step and DP rank only)."""
        if self.saved:
            raise RuntimeError(f"{len(self.saved)} forward(s) of the last step never ran "
                               "backward")  # a schedule bug the checker would have caught
        self.batch, self._backwards = batch, {}

    def forward(self, microbatch: int, chunk: int, x: torch.Tensor | None) -> torch.Tensor:
        model, layout = self.model, self.layout
        docs = self.batch[microbatch][2:]  # the window's document ids, every stage alike
        if layout.is_first(chunk):
            h = model.embed(self.batch[microbatch][0])
        else:
            x = cast(torch.Tensor, x).detach().requires_grad_()  # from the previous stage
            h = x
        for i in layout.layers(chunk):
            h = model.blocks[str(i)](h, model.rope_cos, model.rope_sin, *docs)
        if layout.is_last(chunk):  # the serial model's loss (padded rows masked), its part
            h = model.head_loss(h, self.batch[microbatch][1]) / len(self.batch)
        self.saved[(microbatch, chunk)] = (x, h)
        return h

    def backward(self, microbatch: int, chunk: int, grad: torch.Tensor | None
                 ) -> torch.Tensor | None:
        x, y = self.saved.pop((microbatch, chunk))
        done = self._backwards.get(chunk, 0) + 1
        self._backwards[chunk] = done
        with self.grad_sync(done == len(self.batch)):
            torch.autograd.backward(y, grad)
        return None if x is None else x.grad
