"""Per-rank model construction: no rank ever holds the whole model.

    meta          the GPT (or a pipeline stage of it) on the meta device
    init_stream   the serial init's random numbers in bounded pieces, cut to one shard
    materialise   real parameters for a model built on the meta device
    shards        ZeRO-3: the units built straight into this rank's shards

`build_rank_model` builds the plain GPT on the meta device (shapes, no memory), cuts it to this
rank's pipeline stage, shards it over tensor parallelism (`trainer.parallel.tensor.parallelize`),
applies sequence parallelism and recomputation (`trainer.activations`), and only then allocates the
parameters this rank keeps, each equal to its slice of the serial model's initialisation:
same seed, same weights as a model built whole and cut (Megatron's
``_initialize_affine_weight_cpu`` without the full master weight). Every rank still draws
the whole model's random numbers, in pieces, to stay in step with the serial generator: O(model)
time, O(shard) memory.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import cast

import torch

from trainer.activations import apply_recompute, apply_sequence_parallel
from trainer.comm.protocol import Communicator
from trainer.construction.materialise import materialise
from trainer.construction.meta import meta_gpt
from trainer.construction.shards import materialise_shards
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.parallel.pipeline.partition import StageLayout
from trainer.parallel.tensor.parallelize import parallelize
from trainer.parallel.tensor.random import RNGStatesTracker
from trainer.parallel.zero.units import UnitShards


def build_rank_model(gpt: GPTConfig, seed: int, *, device: torch.device,
                     layout: StageLayout | None = None, tp: Communicator | None = None,
                     tracker: RNGStatesTracker | None = None, sequence_parallel: bool = False,
                     recompute: str = "none") -> GPT:
    """This rank's model (``layout``: its pipeline stage; ``tp``: the group it is sharded
    over) with its initial weights on ``device``."""
    model = meta_rank_model(gpt, seed, device=device, layout=layout, tp=tp, tracker=tracker,
                            sequence_parallel=sequence_parallel, recompute=recompute)
    return materialise(model, seed, tp.rank if tp else 0, tp.size if tp else 1, device)


def build_sharded_model(gpt: GPTConfig, seed: int, *, device: torch.device, dp: Communicator,
                        alone: Collection[str] = (), layout: StageLayout | None = None,
                        tp: Communicator | None = None, tracker: RNGStatesTracker | None = None,
                        sequence_parallel: bool = False, recompute: str = "none",
                        values: Callable[[GPT], Iterable[tuple[str, torch.Tensor]]] | None = None
                        ) -> tuple[GPT, UnitShards]:
    """`build_rank_model` for ZeRO-3: the parameters are views of freed unit buffers and only
    this rank's shards over ``dp`` hold values (`trainer.construction.shards`): the serial
    initialisation's, or those ``values`` streams for the meta model (a Hugging Face
    folder's)."""
    model = meta_rank_model(gpt, seed, device=device, layout=layout, tp=tp, tracker=tracker,
                            sequence_parallel=sequence_parallel, recompute=recompute)
    built = materialise_shards(model, seed, tp_rank=tp.rank if tp else 0,
                               tp_size=tp.size if tp else 1, device=device, dp_size=dp.size,
                               dp_rank=dp.rank, alone=alone,
                               values=None if values is None else values(model))
    return model, built


def meta_rank_model(gpt: GPTConfig, seed: int, *, device: torch.device,
                    layout: StageLayout | None = None, tp: Communicator | None = None,
                    tracker: RNGStatesTracker | None = None, sequence_parallel: bool = False,
                    recompute: str = "none") -> GPT:
    """This rank's model on the meta device: its stage, TP slice, SP and recomputation."""
    tracker = tracker if tracker is not None else RNGStatesTracker(device)
    model = meta_gpt(gpt, seed, layout)
    if tp is not None:
        model = parallelize(model, tp, tracker=tracker)
    if sequence_parallel:  # only with TP (checked with the config)
        model = apply_sequence_parallel(model, cast(Communicator, tp), tracker)
    return apply_recompute(model, recompute, tracker)
