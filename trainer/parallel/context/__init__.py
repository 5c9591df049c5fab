"""Context parallelism: one sequence spread over the ranks of a cp group.

``layout``     which tokens each rank holds (the zig-zag split), batch split and gather (pure)
``plan``       which attention blocks a rank computes under the causal mask, and their FLOPs
``blocks``     one block's attention and the log-sum-exp merge, forward and backward (torch)
``ring``       ring attention: K/V, then dK/dV, passed around the group (autograd Function)
``allgather``  the same attention after one all-gather of K/V per layer (Llama 3's way)
``attention``  `ContextParallelAttention`, the one call both exchanges sit behind

Not yet wired into the trainer's mesh, config or step (issue 37 continues there).
"""

from trainer.parallel.context.attention import (
    EXCHANGES,
    ContextParallelAttention,
    Exchange,
    check_dropout,
)
from trainer.parallel.context.layout import (
    ContextParallelError,
    LocalBatch,
    SequenceLayout,
    gather_sequence,
    split_batch,
)
from trainer.parallel.context.plan import Visibility, attention_flops, block_flops, block_plan

__all__ = [
    "EXCHANGES", "ContextParallelAttention", "ContextParallelError", "Exchange", "LocalBatch",
    "SequenceLayout", "Visibility", "attention_flops", "block_flops", "block_plan",
    "check_dropout", "gather_sequence", "split_batch",
]
