"""Checkpoints of a training run: what a save records, and how a resume finds and loads it.

Which checkpoint: global rank 0 picks the newest committed one and the choice travels to every
rank by broadcasts along DP, then TP, then PP (after the DP broadcast every rank of rank 0's DP
group has it, after TP every rank of the first pipeline stage, after PP everyone), so no rank
can load a different step than the others.

What must match: the model config and the layout along the sharded axes (tp, pp, and with a
pipeline the virtual stages and the layers of every stage, since a ``ppNN`` shard holds those
layers); `trainer.checkpoint.check_compatible` lists every difference. dp may change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.comm.protocol import Communicator
from trainer.config import TrainConfig

#: Options that steer one invocation rather than the training math (not reported on resume).
RUN_CONTROL = {"steps", "stop_at", "resume", "save_every", "keep", "log_every", "run_dir",
               "dp", "backend", "gpt"}


def layout_of(cfg: TrainConfig) -> dict[str, Any]:
    """The parallel layout a checkpoint records (and a resume must match along tp and pp)."""
    return {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
            "virtual_stages": cfg.virtual_stages if cfg.schedule == "interleaved" else 1,
            "stage_layers": list(cfg.stage_layers)}


def restore(cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            deciders: Sequence[Communicator], shard: tuple[int, int], device: torch.device
            ) -> tuple[int, list[str]]:
    """Load the newest committed checkpoint into ``model``/``optimizer`` (this rank's (tp, pp)
    ``shard``); returns its step (0: none) and the training options changed since it was
    written. ``deciders``: the DP, TP and PP groups, in that order (see the docstring)."""
    root = Path(cfg.run_dir) / "checkpoints"
    found = checkpoint.latest(root)
    choice = torch.tensor([checkpoint.step_of(found) if found else -1], device=device)
    for comm in deciders:
        comm.broadcast(choice, 0)
    step = int(choice.item())
    if step < 0:
        return 0, []
    path = root / f"step-{step}"
    if not path.is_dir():
        raise checkpoint.CheckpointError(
            "checkpoint not visible on this rank", str(path),
            f"rank 0 resumes from step {step} but this rank (tp, pp shard {shard}) cannot see "
            "the folder", "Put --run-dir on a filesystem that every host shares")
    checkpoint.check_compatible(checkpoint.read_meta(path), model=cfg.gpt.to_dict(),
                                layout=layout_of(cfg), path=path)
    ckpt = checkpoint.load(path, map_location=device, shard=shard)
    model.load_state_dict(ckpt.model)
    optimizer.load_state_dict(ckpt.optim)
    checkpoint.restore_rng(ckpt.rng)
    before, now = ckpt.meta.get("config", {}), cfg.to_dict()
    changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items()
               if k not in RUN_CONTROL and k in before and before[k] != v]
    return ckpt.step, changed


def meta_of(cfg: TrainConfig, step: int, *, source: str, fingerprint: str) -> dict[str, Any]:
    """The meta.json body of a save at ``step``."""
    return {"config": cfg.to_dict(), "model": cfg.gpt.to_dict(), "layout": layout_of(cfg),
            "data": {"position": step, "source": source, "fingerprint": fingerprint}}
