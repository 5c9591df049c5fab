"""Context parallelism: one sequence spread over the ranks of a cp group.

``layout``     which tokens each rank holds (the zig-zag split), batch split and gather (pure)
``plan``       which attention blocks a rank computes under the causal mask, and their FLOPs
``blocks``     one block's attention and the log-sum-exp merge, forward and backward (torch)
``documents``  document masking (``--document-mask``): each block's mask from the window's
               global document ids, blocks no query of which sees a key left out
``ring``       ring attention: K/V, then dK/dV, passed around the group (autograd Function)
``allgather``  the same attention after one all-gather of K/V per layer (Llama 3's way)
``attention``  `ContextParallelAttention`, the one call both exchanges sit behind
``model``      `context_parallel`: a rank's model on its share of every sequence (rotary rows at
               global positions, each block's attention core), and `keep_chunks`, the data
               loader's cut of each window (`trainer.data.batches.Keep`)
``checks``     what ``--cp`` refuses when the options are read (a sequence that does not split
               into 2 x cp chunks, dropout, compiled blocks, hybrid sharding)

The run (`trainer.training.run.build_run`) turns it on once when ``--cp`` is above 1: cp is an
axis of the mesh (`trainer.comm.topology`, right after tp), the parameters are replicated over
it, so gradients are averaged over dp x cp (``dp_cp``, over which ZeRO-1, 2 and 3 shard; a
rank's loss is the mean over its tokens, and every rank holds as many) and so is the logged
loss; the gradient norm counts each parameter once (the first cp rank). Checkpoints do not
depend on cp: a run resumes at any cp.

Recomputation re-runs the exchange (chosen): under ``--recompute selective`` the attention
core's forward, ring or all-gather included, runs again in backward, and ``full`` re-runs the
block. What the ring keeps for backward is already small (q, k, v, the output and the
log-sum-exp per row: O(T/cp), never a T x T matrix), so saving the exchange's results would keep
the K/V of every rank for every layer (cp times the local K/V) to spare one ring pass per layer;
re-running keeps the memory of recomputation at the price of that pass, which overlaps the
block computations as in forward.
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
from trainer.parallel.context.model import context_parallel, keep_chunks
from trainer.parallel.context.plan import Visibility, attention_flops, block_flops, block_plan

__all__ = [
    "EXCHANGES", "ContextParallelAttention", "ContextParallelError", "Exchange", "LocalBatch",
    "SequenceLayout", "Visibility", "attention_flops", "block_flops", "block_plan",
    "check_dropout", "context_parallel", "gather_sequence", "keep_chunks", "split_batch",
]
