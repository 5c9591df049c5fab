"""ZeRO-1: the optimizer state and fp32 main weights sharded over data parallelism.

    python -m trainer.train --model small --dp 2 --zero 1 --run-dir runs/zero

* `trainer.zero.layout`     which gradient elements a DP rank owns (buckets padded to dp)
* `trainer.zero.grad_sync`  `DataParallel` with a bucketed, overlapped reduce-scatter
* `trainer.zero.optimizer`  AdamW over this rank's shard, then the all-gather of parameters
* `trainer.zero.memory`     expected and held bytes per rank, peak memory per step

A ZeRO-1 piece carries its placement (`trainer.placement`): a checkpoint holds each piece
once, and a run resumes at any layout, ZeRO-1 or not (`trainer.checkpoint.pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.zero.grad_sync import ShardedGradSync
from trainer.zero.optimizer import ZeroOptimizer

__all__ = ["ShardedGradSync", "ZeroOptimizer", "build_zero"]


def build_zero(model: nn.Module, optimizer: torch.optim.Optimizer, dp: Communicator,
               dtype: torch.dtype | None, *, bucket_size: int, overlap: bool,
               reduce_dtype: torch.dtype | None, alone: Sequence[nn.Parameter] = (),
               blocked: Callable[[], AbstractContextManager[None]] = nullcontext
               ) -> tuple[ShardedGradSync, ZeroOptimizer]:
    """The gradient sync and the sharded optimizer of ``model`` (fp32, restored if resuming;
    cast to ``dtype`` at the end, after DP's broadcast from rank 0). ``optimizer``: AdamW over
    the whole model, whose groups, hyperparameters and (restored) state the shards take.
    ``blocked``: marks the step's wait for the parameters' all-gather."""
    sync = ShardedGradSync(model, dp, bucket_size=bucket_size, overlap=overlap,
                           reduce_dtype=reduce_dtype, alone=alone)
    return sync, ZeroOptimizer(sync, optimizer, dtype, blocked)
