"""Megatron-style tensor parallelism on the trainer's `Communicator`.

``mappings`` (the f/g autograd collectives), ``layers`` (column/row-parallel linear,
vocabulary-parallel embedding), ``cross_entropy`` (vocabulary-parallel loss), ``random`` (RNG
tracker and RNG-safe recompute), ``sharding`` (how tensors are cut and re-assembled) and
``counting`` (a communicator that counts traffic). ``trainer.parallel.tensor.parallelize`` applies
them to the GPT; ``gqa`` splits the Llama block (grouped-query attention, SwiGLU).
"""

from trainer.parallel.tensor.cross_entropy import (
    mean_vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy,
)
from trainer.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from trainer.parallel.tensor.random import TP_RNG, RNGStatesTracker, checkpoint
from trainer.parallel.tensor.sharding import (
    ShardSpec,
    TensorParallelError,
    full_state,
    gather_full,
    shard_spec,
    shard_tensor,
    unshard,
)

__all__ = [
    "TP_RNG", "ColumnParallelLinear", "RNGStatesTracker", "RowParallelLinear", "ShardSpec",
    "TensorParallelError", "VocabParallelEmbedding", "checkpoint", "full_state", "gather_full",
    "mean_vocab_parallel_cross_entropy", "shard_spec", "shard_tensor",
    "unshard", "vocab_parallel_cross_entropy",
]
