"""Model-parallel sparse embeddings in the style of NVIDIA SOK (sparse_operation_kit).

A table too large for one device is sharded by key over the G ranks of a communicator (owner =
key mod G); each rank looks up any key as if it held the whole table. Modules, in the order a
step uses them:

    keys       owners, routing plans (bucket by owner, remember positions), per-key init (pure)
    hashing    open-addressing key -> row index of hash mode (get-or-insert / get-only)
    exchange   the all-to-alls: counts, keys to owners, rows back, gradients to owners
    table      `ShardedEmbedding`: lookup + sum/mean pooling, autograd backward to owners
    optim      row-wise sparse SGD, Adagrad and lazy Adam over the touched rows

Usage: docs/training/recommender.md; the recommender that trains on them: `trainer.recsys`.
"""

from trainer.sparse.hashing import KeyIndex, SparseError
from trainer.sparse.optim import KINDS, SparseOptimizer
from trainer.sparse.table import COMBINERS, ShardedEmbedding

__all__ = ["COMBINERS", "KINDS", "KeyIndex", "ShardedEmbedding", "SparseError",
           "SparseOptimizer"]
