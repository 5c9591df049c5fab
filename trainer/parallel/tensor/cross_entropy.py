"""Cross entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each TP rank holds the logits of its vocabulary slice ``[r*V/tp, (r+1)*V/tp)`` (the output of
a column-parallel head). Per token, three all-reduces over the TP group give the exact
softmax cross entropy (Megatron ``_VocabParallelCrossEntropy``):

1. MAX of the per-rank maxima, subtracted from the logits for numerical stability;
2. SUM of the target's logit (only the rank owning the target contributes; others add 0);
3. SUM of the per-rank sums of ``exp``.

``loss = log(sum_exp) - target_logit``. Backward needs no communication: the gradient of the
local slice is ``softmax - onehot(target)`` restricted to the slice. Memory and traffic are
O(tokens * V/tp) and O(tokens) respectively, never O(tokens * V).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from trainer.comm.protocol import Communicator, ReduceOp
from trainer.model.precision import at_least_fp32


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Communicator
                ) -> torch.Tensor:
        logits = at_least_fp32(logits)  # as the serial loss
        per_rank = logits.shape[-1]
        start = comm.rank * per_rank
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(outside, 0.0).contiguous()
        comm.all_reduce(picked, ReduceOp.SUM)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, ReduceOp.SUM)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 comm: Communicator) -> torch.Tensor:
    """Per-token loss ``(N,)`` from this rank's logit slice ``(N, V/tp)`` and targets ``(N,)``
    (global token ids). Every TP rank gets the same losses."""
    if comm.size == 1:
        return F.cross_entropy(at_least_fp32(logits), target, reduction="none")
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, comm)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return out


def mean_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                      comm: Communicator) -> torch.Tensor:
    """Mean over tokens, like ``F.cross_entropy``'s default (what ``GPT.loss`` returns)."""
    if comm.size == 1:
        return F.cross_entropy(at_least_fp32(logits), target)
    return vocab_parallel_cross_entropy(logits, target, comm).mean()
