"""What a checkpoint holds, for tests: every saved tensor put together (through the trainer's
reader, so every file is verified), and a rank's slice of a whole tensor cut the way the
trainer's own TP code cuts it (`trainer.parallel.tensor.sharding.shard_tensor`), independently
of the placement arithmetic under test."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint.pieces import MOMENTS, PARAM, assemble
from trainer.parallel.tensor.sharding import ShardSpec, shard_tensor
from trainer.placement import Placement

KINDS = (PARAM, *MOMENTS)


def saved_state(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> global name -> the whole tensor, of checkpoint folder ``path``."""
    return {kind: assemble(path, kind) for kind in KINDS}


def slice_of(full: torch.Tensor, p: Placement) -> torch.Tensor:
    """The flat data a rank with placement ``p`` holds of the whole tensor ``full``."""
    local = full if p.tp is None else shard_tensor(full, p.tp.rank, p.tp.size,
                                                   ShardSpec(p.tp.dim, p.tp.stride))
    flat = local.reshape(-1)
    return flat[p.flat[0]:p.flat[1]] if p.flat else flat


def same_states(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]
                ) -> list[str]:
    """What differs between two saved states, bit for bit (empty: nothing)."""
    diffs = [f"{kind}: {sorted(set(a[kind]) ^ set(b[kind]))}" for kind in KINDS
             if a[kind].keys() != b[kind].keys()]
    return diffs + [f"{kind}/{name}" for kind in KINDS for name in a[kind]
                    if name in b[kind] and not torch.equal(a[kind][name], b[kind][name])]
