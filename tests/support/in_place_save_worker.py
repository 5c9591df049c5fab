"""One rank of `tests.trainer.test_save_start`'s saves in place: a save waited for
(`trainer.training.checkpointing.Checkpoints`, ``--no-async-save`` on 2 ranks, dp 2) agrees on
the weights' check and AdamW's step count in the one collective after the writes (the folder
named by the run's token), with no collective before them.

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.in_place_save_worker:run OUT

After one step, rank 1 makes one of its parameters infinite and both ranks save step 1: the
save raises the divergence on both, and its folder (written by then) is gone. Then, the
parameter restored and rank 1's AdamW step count raised to 5, step 1 is saved again and
committed with the count every rank agreed, each rank's record (left in the folder for the
leader) removed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.layout import committed
from trainer.comm.bootstrap import init
from trainer.config.options import make_config, resolve_dp
from trainer.training.checkpointing import Checkpoints
from trainer.training.guard import DivergedError
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    cfg = resolve_dp(make_config({"model": "tiny", "steps": 2, "global_batch": 4, "dp": 2,
                                  "warmup_steps": 1, "data_cap_mb": 0.25, "eval_every": 0,
                                  "run_dir": str(out / "run"), "seed": 3,
                                  "async_save": False},
                                 {"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8}),
                     world.size)
    built = build_run(cfg, mesh_for(cfg, world))
    train_step(built, 1)
    saves = Checkpoints(built, world)
    param = next(iter(built.weights.values()))
    kept = param.detach().clone()
    if world.rank == 1:
        with torch.no_grad():
            param.view(-1)[0] = math.inf
    refused = ""
    try:
        saves.save(1)
    except DivergedError as exc:
        refused = str(exc)
    root = out / "run" / "checkpoints"
    world.mpi_comm.Barrier()  # looked at before any rank saves again
    left = sorted(p.name for p in root.iterdir()) if world.rank == 0 and root.exists() else []
    world.mpi_comm.Barrier()
    with torch.no_grad():
        param.copy_(kept)
    if world.rank == 1:
        for state in built.weights.optimizer.state.values():
            state["step"] = torch.tensor(5.0)
    saves.save(1)
    reports = saves.take_reports()
    saves.close(clean=True)
    meta = json.loads((root / "step-1" / "meta.json").read_text()) if world.rank == 0 else {}
    return {"refused": refused, "left": left, "committed": committed(root / "step-1"),
            "files": sorted(p.name for p in (root / "step-1").iterdir()),
            "adam_step": meta.get("optimizer", {}).get("step"), "reports": reports}
