"""One rank of `tests.trainer.test_save_start`: a save's first phase
(`trainer.training.checkpointing.
begin`, its one agreement) on a real run of 2 ranks (dp 2).

    mpiexec -n 2 python -m tests.support.mpi_worker tests.support.save_start_worker:run OUT

After one step, rank 1 makes one of its parameters infinite and both ranks begin a save of step
1: every rank must raise the divergence, and no folder of the save may be left behind. Then,
the parameter restored, a save of step 1 begins, is written and committed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.writer import Writer
from trainer.comm.bootstrap import init
from trainer.config.options import make_config, resolve_dp
from trainer.training.checkpointing import begin
from trainer.training.guard import DivergedError
from trainer.training.run import build_run, mesh_for
from trainer.training.step import train_step


def run(out: Path) -> dict[str, Any]:
    world = init(backend="mpi")
    cfg = resolve_dp(make_config({"model": "tiny", "steps": 2, "global_batch": 4, "dp": 2,
                                  "warmup_steps": 1, "data_cap_mb": 0.25, "eval_every": 0,
                                  "run_dir": str(out / "run"), "seed": 3},
                                 {"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8}),
                     world.size)
    built = build_run(cfg, mesh_for(cfg, world))
    train_step(built, 1)
    param = next(iter(built.weights.values()))
    kept = param.detach().clone()
    if world.rank == 1:
        with torch.no_grad():
            param.view(-1)[0] = math.inf
    refused = ""
    try:
        begin(built, 1)
    except DivergedError as exc:
        refused = str(exc)
    # Looked at by the leader, who removes the folder it created before it raises.
    left = sorted(p.name for p in (out / "run" / "checkpoints").iterdir()) \
        if world.rank == 0 else None
    with torch.no_grad():
        param.copy_(kept)
    job = begin(built, 1)
    assert job is not None
    writer = Writer(None, background=False)
    writer.submit(job)
    writer.wait()
    return {"refused": refused, "left": left, "saved": job.final.name,
            "adam_step": job.meta["optimizer"]["step"] if world.rank == 0 else None}
