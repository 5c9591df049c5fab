"""ZeRO-1, 2 and 3: the optimizer state and fp32 main weights (1), the gradients (2), and the
parameters (3) sharded over data parallelism (optionally inside groups of
``--zero-shard-size`` ranks and replicated across them: hybrid sharding).

    python -m trainer.train --model small --dp 2 --zero 1 --run-dir runs/zero
    python -m trainer.train --model small --dp 4 --zero 2 --run-dir runs/zero2
    python -m trainer.train --model small --dp 4 --zero 3 --zero-shard-size 2 --run-dir runs/z3

* `trainer.parallel.zero.layout`      which gradient elements a DP rank owns (buckets padded to dp)
* `trainer.parallel.zero.grad_sync`   ZeRO-1: `DataParallel` with a bucketed, overlapped
  reduce-scatter
                             into a whole gradient buffer
* `trainer.parallel.zero.grad_shards` ZeRO-2: the same reduce-scatters into this rank's shards only,
                             each bucket staged while backward fills it and freed once reduced
* `trainer.parallel.zero.unit_grads`  ZeRO-3's gradient shards: one bucket per unit, reduced
                             when complete, in hook order
* `trainer.parallel.zero.units`       ZeRO-3: parameter units (a block, the root) sharded,
                             gathered before forward and backward, freed after, prefetched
* `trainer.parallel.zero.split`       ZeRO-3 of a mixture of experts: dense units sharded over
                             dp, the experts' over their expert-data-parallel group
* `trainer.parallel.zero.optimizer`   AdamW over this rank's shard, then the all-gather of
  parameters
* `trainer.parallel.zero.memory`      expected and held bytes per rank, peak memory per step
* `trainer.parallel.zero.checks`      the stages and what they run with, refused before any work

Both stages own the same elements (the layout) and step the same pieces, so a piece carries
its placement (`trainer.placement`): a checkpoint holds each piece once, and a run resumes at
any layout and stage, ZeRO or not (`trainer.checkpoint.pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from trainer.comm.protocol import Communicator
from trainer.parallel.zero.grad_shards import ShardedGradients
from trainer.parallel.zero.grad_sync import ShardedGradSync
from trainer.parallel.zero.optimizer import ZeroOptimizer
from trainer.parallel.zero.unit_grads import UnitGradients
from trainer.parallel.zero.units import ParamUnits, UnitShards, Zero3Optimizer
from trainer.placement.parameters import DP_AXES

__all__ = ["ParamUnits", "ShardedGradSync", "ShardedGradients", "UnitGradients",
           "Zero3Optimizer", "ZeroOptimizer", "build_zero"]


def build_zero(model: nn.Module, optimizer: torch.optim.Optimizer, dp: Communicator,
               dtype: torch.dtype | None, *, stage: int, bucket_size: int, overlap: bool,
               reduce_dtype: torch.dtype | None, alone: Sequence[nn.Parameter] = (),
               prefetch: int = 1,
               blocked: Callable[[], AbstractContextManager[None]] = nullcontext,
               replicas: Communicator | None = None, over: tuple[str, ...] = DP_AXES,
               built: UnitShards | None = None
               ) -> tuple[ShardedGradSync | ShardedGradients, ZeroOptimizer]:
    """The gradient sync of ZeRO ``stage`` (1: a whole buffer, 2: the shards alone) and the
    sharded optimizer of ``model`` (fp32, restored if resuming; cast to ``dtype`` at the end,
    after DP's broadcast from rank 0). ``optimizer``: AdamW over the whole model, whose groups,
    hyperparameters and (restored) state the shards take. ``blocked``: marks the step's wait
    for the parameters' all-gather. Stage 3 shards the parameters too, in units gathered
    ``prefetch`` blocks ahead (`trainer.parallel.zero.units`; under bf16 the units are
    held in bf16 over fp32 main pieces). Under hybrid sharding (every stage) ``dp`` is the
    shard group,
    ``replicas`` the groups' same places and ``over`` the axes the pieces are sharded over.
    ``built``: the units as `trainer.construction.build_sharded_model` made them."""
    if stage == 3:
        units = UnitGradients(model, dp, bucket_size=bucket_size, overlap=overlap,
                              reduce_dtype=reduce_dtype, alone=alone, replicas=replicas,
                              built=built is not None)
        units.in_flight = prefetch  # as many units' gradients reducing as gathered ahead
        return units, Zero3Optimizer(units, optimizer,
                                     ParamUnits(model, units, prefetch, built),
                                     dtype, blocked, over=over)
    kind = ShardedGradients if stage == 2 else ShardedGradSync
    sync = kind(model, dp, bucket_size=bucket_size, overlap=overlap, reduce_dtype=reduce_dtype,
                alone=alone, replicas=replicas)
    return sync, ZeroOptimizer(sync, optimizer, dtype, blocked, over=over)
