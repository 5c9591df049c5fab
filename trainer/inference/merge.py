"""A checkpoint of any layout back into the single-device `trainer.model.gpt.GPT`, on one process.

A checkpoint holds one model shard per (tp, pp[, ep]) rank of DP replica 0 (with expert
parallelism, of the first ep replicas: each holds its own experts; `trainer.checkpoint`), and
its ``meta.json`` the model config and the layout. Pipeline shards keep global parameter names
(``blocks.5...``), so the stages' shards are simply united; the last stage's copy of a tied
embedding (``head.weight``) equals the first stage's weight. Tensor-parallel shards of one
stage are put back together with `trainer.tensor_parallel.unshard`, along the dimension and
stride where `trainer.tensor_parallel.parallelize` cut each parameter: the TP model is built offline
on a `LayoutOnlyGroup` (a group's rank and size, no transport) only to read those cuts, so the
rules live in one place. The result is loaded strictly: a missing or extra tensor is an error.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.errors import CommError
from trainer.model.config import GPTConfig
from trainer.model.family import build_model
from trainer.model.gpt import GPT
from trainer.moe.parallel import shard_experts
from trainer.tensor_parallel import ShardSpec
from trainer.tensor_parallel.parallelize import parallelize
from trainer.tensor_parallel.random import RNGStatesTracker
from trainer.tensor_parallel.sharding import shard_spec, unshard


class LayoutOnlyGroup:
    """Rank 0 of a group of ``size``, for building sharded modules offline; cannot communicate."""

    def __init__(self, size: int) -> None:
        self.rank, self.size, self.name, self.backend = 0, size, "layout-only", "none"

    def __getattr__(self, op: str) -> Any:
        raise CommError("a layout-only group cannot communicate", f"{op}()",
                        "it only describes a group's rank and size",
                        "Use a real communicator to run the model")


def shard_specs(cfg: GPTConfig, tp: int) -> dict[str, ShardSpec]:
    """Where `trainer.tensor_parallel.parallelize` cuts each parameter at ``tp`` (state-dict names;
    replicated parameters are absent)."""
    if tp == 1:
        return {}
    group = LayoutOnlyGroup(tp)
    model = parallelize(build_model(cfg), group, tracker=RNGStatesTracker())
    shard_experts(model, LayoutOnlyGroup(1), group)  # experts split like the MLP (trainer.moe)
    return {name: spec for name, p in model.named_parameters(remove_duplicate=False)
            if (spec := shard_spec(p)) is not None}


def load_serial(path: Path) -> tuple[GPT, dict[str, Any]]:
    """The single-device GPT of the committed checkpoint folder ``path``, and its meta."""
    meta = checkpoint.load(path).meta  # every file it reads is verified against the record
    cfg = GPTConfig.from_dict(meta["model"])
    tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    specs = shard_specs(cfg, tp)
    full: dict[str, torch.Tensor] = {}
    # Each EP shard holds its own experts and a copy of the dense parameters.
    for stage, ep_rank in itertools.product(range(pp), range(meta["layout"].get("ep", 1))):
        shards = [checkpoint.load(path, shard=(t, stage, ep_rank)).model for t in range(tp)]
        for name, tensor in shards[0].items():
            spec = specs.get(name)
            if name not in full:  # (the tied head copy of the last stage is already in)
                full[name] = unshard([s[name] for s in shards], spec) if spec else tensor
    model = build_model(cfg)
    try:
        model.load_state_dict(full)
    except RuntimeError as exc:
        raise checkpoint.CheckpointError(
            "checkpoint does not rebuild the model", str(path), str(exc).splitlines()[0],
            "Check that every model-tpNN-ppNN.pt shard of the layout in meta.json is there"
        ) from None
    return model.eval(), meta
