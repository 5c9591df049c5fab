"""Megatron's sequence parallelism (Korthikanti et al. 2022) on the tensor-parallel GPT.

`trainer.parallel.tensor.parallelize` makes every tensor-parallel region (attention, MLP, embedding,
head) hold its slice of the weights, but the activations *between* the regions, the norms, the
dropouts and the residual sums, stay whole and identical on every TP rank. `apply_sequence_parallel`
splits them along the sequence instead, so each TP rank holds and computes ``1/tp`` of them:

    tok_emb      reduce-scatter over the sequence instead of all-reduce (B, T/tp, D)
    ln1/ln2/ln_f run on the rank's sequence block; their parameters' gradients are summed
                 over TP in backward (each rank saw only its tokens: Megatron-LM#1446 is
                 that sum forgotten)
    qkv, fc      all-gather the sequence before the column-parallel matmul (backward:
                 reduce-scatter of the input gradient); a Llama's q and kv alike
    proj         reduce-scatter the row-parallel partial sums instead of all-reducing them;
                 a replicated bias is added to the block and its gradient summed over TP
    head         all-gather the sequence before the vocabulary-parallel matmul
    dropout      the embedding, attention-output and MLP-output dropouts act on per-rank
                 sequence blocks, so they draw from the tracker's TP stream (one mask per
                 rank, PaddleFleetX#1005); attention-probability dropout already does

An all-reduce is a reduce-scatter plus an all-gather, so the traffic per block is unchanged
(Megatron's claim); the memory of every activation outside the TP regions is divided by tp.
With dropout off the results equal those of plain TP up to the order of sums.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.model.gpt import GPT
from trainer.model.layers import RMSNorm
from trainer.parallel.tensor.mappings import copy_to_region
from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker


class SequenceParallelNorm(nn.Module):
    """A LayerNorm or RMSNorm on the rank's sequence block. It keeps the wrapped norm's
    parameters (same names, same objects) and sums their gradients over TP in backward."""

    def __init__(self, norm: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.comm, self.eps = comm, cast(float, norm.eps)
        self.rms = isinstance(norm, RMSNorm)
        self.weight = cast(nn.Parameter, norm.weight)
        self.bias = getattr(norm, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # copy_to_region: identity forward, all-reduce of the gradient over TP backward.
        weight = copy_to_region(self.weight, self.comm)
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        bias = copy_to_region(self.bias, self.comm) if self.bias is not None else None
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{'rmsnorm' if self.rms else 'layernorm'}, eps={self.eps}, sequence_parallel"


class TrackedDropout(nn.Dropout):
    """Dropout whose mask comes from a tracked random stream (per TP rank)."""

    def __init__(self, p: float, tracker: RNGStatesTracker, stream: str = TP_RNG) -> None:
        super().__init__(p)
        self.tracker, self.stream = tracker, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.stream):
            return super().forward(x)


def apply_sequence_parallel(model: GPT, tp: Communicator, tracker: RNGStatesTracker) -> GPT:
    """Switch a model already sharded by `trainer.parallel.tensor.parallelize` over ``tp`` to
    sequence parallelism, in place (a stage model: only the parts it holds)."""
    p = model.cfg.dropout
    for _, block in model.layers():
        block.ln1 = SequenceParallelNorm(block.ln1, tp)
        block.ln2 = SequenceParallelNorm(block.ln2, tp)
        for layer in (*block.attn.children(), *block.mlp.children()):
            if hasattr(layer, "sequence_parallel"):  # the tensor-parallel linears of any family
                layer.sequence_parallel = True  # type: ignore[assignment]  # its own flag
        block.attn.resid_drop = TrackedDropout(p, tracker)
        block.mlp.drop = TrackedDropout(p, tracker)
    if model.tok_emb is not None:
        model.tok_emb.sequence_parallel = True  # type: ignore[assignment]  # its own flag
        model.emb_drop = TrackedDropout(p, tracker)
    if model.ln_f is not None:
        model.ln_f = SequenceParallelNorm(model.ln_f, tp)
    if model.head is not None:
        model.head.sequence_parallel = True  # type: ignore[assignment]  # its own flag
    return model
